"""Dropless expert parallelism: token slots travel to the devices holding their experts and back with
``all_to_all`` inside ``shard_map``.

On a mesh whose ``expert`` axis has ``P`` devices, device ``p`` holds experts ``p * E/P .. (p+1) * E/P - 1``
and its own slice of the tokens. Each device

1. sorts its ``T*k`` token slots by expert, so they are grouped by destination device, and counts them
   (the send counts);
2. exchanges them with one ``all_to_all`` over ``expert`` into a ``[P, T*k, embed]`` receive buffer
   (static shapes: each destination's chunk is padded to ``T*k`` rows, the worst case of every slot
   choosing that device's experts; padding rows carry the id ``E/P`` and are skipped by the compute);
3. runs its local experts on the rows it received (``jax.lax.ragged_dot`` over the rows sorted by
   expert, with their LoRA adapters' rank-``r`` products when the experts have them), summing partial
   results over ``tensor`` when expert widths are split there;
4. sends the outputs back with a second ``all_to_all`` and combines each token's ``k`` outputs with its
   routing weights.

Communication per MoE layer and device: ``2 * P * T*k * embed`` elements (send and return, padded);
the rows that carry tokens are ``2 * T*k * embed``. ``jax.lax.ragged_all_to_all`` would send only those.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int

from eqmoe.config import MoEConfig
from eqmoe.nn.dispatch import Experts, ragged_matmul
from eqmoe.nn.lora import ExpertAdapters
from eqmoe.nn.mlp import silu
from eqmoe.nn.router import Routing
from eqmoe.parallel import Parallelism


def _local_experts(
    rows: Float[Array, "rows embed"],
    ids: Int[Array, " rows"],
    w_gate: Float[Array, "local embed expert_dim"],
    w_up: Float[Array, "local embed expert_dim"],
    w_down: Float[Array, "local expert_dim embed"],
    lora: ExpertAdapters | None,
) -> Float[Array, "rows embed"]:
    """Each row through its local expert ``ids[r]``; rows with ``ids == local`` (padding) give zeros.

    ``jax.lax.ragged_dot`` over the rows sorted by expert: padding sorts last, outside every group.
    (The CPU block kernel :mod:`eqmoe.nn.grouped` skips blocks with ``lax.cond``, which ``shard_map``'s
    varying-axis typing rejects in its hand-written backward pass.)"""
    local = w_gate.shape[0]
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.bincount(ids, length=local + 1)[:local].astype(jnp.int32)
    sorted_rows = rows[order]
    gate = ragged_matmul(sorted_rows, w_gate, sizes, lora, "gate")
    hidden = silu(gate) * ragged_matmul(sorted_rows, w_up, sizes, lora, "up")
    out = ragged_matmul(hidden, w_down, sizes, lora, "down")
    return jnp.zeros_like(out).at[order].set(out)


def _adapter_specs(lora: ExpertAdapters | None, width_axes) -> ExpertAdapters | None:
    """Each adapter factor's ``PartitionSpec``: split over ``expert`` like its weight, its ``expert_mlp``
    axis (if any) over the weight's width axes; ``embed`` and the rank stay whole on every device."""
    if lora is None:
        return None
    whole, width_last, width_middle = (
        PartitionSpec("expert", None, None),
        PartitionSpec("expert", None, width_axes),
        PartitionSpec("expert", width_axes, None),
    )
    specs = dict(gate_a=whole, gate_b=width_last, up_a=whole, up_b=width_last, down_a=width_middle, down_b=whole)
    return dataclasses.replace(lora, **{name: None if getattr(lora, name) is None else s for name, s in specs.items()})


def expert_parallel(
    x: Float[Array, "tokens embed"], routing: Routing, params: Experts, config: MoEConfig, parallelism: Parallelism
) -> Float[Array, "tokens embed"]:
    """The dropless MoE output with experts split over the mesh's ``expert`` axis (see the module docstring)."""
    token_axes = parallelism.mesh_axes("batch") or None
    width_axes = parallelism.mesh_axes("expert_mlp") or None
    tokens = PartitionSpec(token_axes, None)
    w_in, w_out = PartitionSpec("expert", None, width_axes), PartitionSpec("expert", width_axes, None)
    num_experts = params.w_gate.shape[0]
    if num_experts % parallelism.size("expert"):
        raise ValueError(
            f"expert parallelism: {num_experts} experts do not split over expert={parallelism.size('expert')}"
        )

    def local(x, experts, weights, w_gate, w_up, w_down, lora):
        count, top_k = experts.shape
        slots, embed, local_experts = count * top_k, x.shape[1], w_gate.shape[0]
        devices = jax.lax.axis_size("expert")
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        destination = flat[order] // local_experts
        sent = jnp.bincount(destination, length=devices)
        position = jnp.arange(slots) - (jnp.cumsum(sent) - sent)[destination]
        send = jnp.zeros((devices, slots, embed), x.dtype).at[destination, position].set(x[order // top_k])
        send_ids = jnp.full((devices, slots), local_experts, jnp.int32)
        send_ids = send_ids.at[destination, position].set(flat[order] - destination * local_experts)
        received = jax.lax.all_to_all(send, "expert", 0, 0)
        received_ids = jax.lax.all_to_all(send_ids, "expert", 0, 0)
        out = _local_experts(received.reshape(-1, embed), received_ids.reshape(-1), w_gate, w_up, w_down, lora)
        if width_axes:
            out = jax.lax.psum(out, width_axes)
        returned = jax.lax.all_to_all(out.reshape(devices, slots, embed), "expert", 0, 0)
        slot_outputs = jnp.zeros((slots, embed), out.dtype).at[order].set(returned[destination, position])
        combined = jnp.einsum("tk,tkd->td", weights, slot_outputs.reshape(count, top_k, embed))
        return combined.astype(x.dtype)

    run = jax.shard_map(
        local,
        mesh=parallelism.mesh,
        in_specs=(tokens, tokens, tokens, w_in, w_in, w_out, _adapter_specs(params.lora, width_axes)),
        out_specs=tokens,
    )
    return run(x, routing.experts, routing.weights, params.w_gate, params.w_up, params.w_down, params.lora)
