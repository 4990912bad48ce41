"""Dropless expert parallelism: token slots travel to the devices holding their experts and back with
``all_to_all`` inside ``shard_map``.

On a mesh whose ``expert`` axis has ``P`` devices, device ``p`` holds experts ``p * E/P .. (p+1) * E/P - 1``
and its own slice of the tokens. Each device

1. sorts its ``T*k`` token slots by expert, so they are grouped by destination device, and counts them
   (the send counts);
2. exchanges them with one ``all_to_all`` over ``expert`` into a ``[P, T*k, embed]`` receive buffer
   (static shapes: each destination's chunk is padded to ``T*k`` rows, the worst case of every slot
   choosing that device's experts; padding rows carry the id ``E/P`` and are skipped by the compute);
3. runs its local experts on the rows it received (their ragged products over the rows sorted by expert,
   whatever biases or adapters the matrices carry), summing partial results over ``tensor`` when expert widths
   are split there (the output side's bias added once, after that sum);
4. sends the outputs back with a second ``all_to_all`` and combines each token's ``k`` outputs with its
   routing weights.

Communication per MoE layer and device: ``2 * P * T*k * embed`` elements (send and return, padded);
the rows that carry tokens are ``2 * T*k * embed``. ``jax.lax.ragged_all_to_all`` would send only those.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int

from eqmoe.config import MoEConfig
from eqmoe.nn.experts import RoutedExperts
from eqmoe.nn.router import Routing
from eqmoe.parallel import Parallelism, tree_shardings


def _local_experts(rows: Float[Array, "rows embed"], ids: Int[Array, " rows"], experts: RoutedExperts) -> Array:
    """Each row through its local expert ``ids[r]``; rows with ``ids == local`` (padding) give zeros.

    The experts' ragged products over the rows sorted by expert: padding sorts last, outside every group.
    (The CPU block kernel :mod:`eqmoe.nn.grouped` skips blocks with ``lax.cond``, which ``shard_map``'s
    varying-axis typing rejects in its hand-written backward pass.)"""
    local = experts.num_experts
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.bincount(ids, length=local + 1)[:local].astype(jnp.int32)
    product = lambda w, x: w.ragged(x, sizes)  # noqa: E731
    out = experts.apply(rows[order], product, product)
    return jnp.zeros_like(out).at[order].set(out)


def expert_parallel(
    x: Float[Array, "tokens embed"],
    routing: Routing,
    experts: RoutedExperts,
    config: MoEConfig,
    parallelism: Parallelism,
) -> Float[Array, "tokens embed"]:
    """The dropless MoE output with experts split over the mesh's ``expert`` axis (see the module docstring)."""
    token_axes = parallelism.mesh_axes("batch") or None
    width_axes = parallelism.mesh_axes("expert_mlp") or None
    tokens = PartitionSpec(token_axes, None)
    num_experts = experts.num_experts
    if num_experts % parallelism.size("expert"):
        raise ValueError(
            f"expert parallelism: {num_experts} experts do not split over expert={parallelism.size('expert')}"
        )
    # Inside the map each device holds its experts whole but for the widths the tensor axes split: every matrix
    # (and whatever it carries) by its declared axes, all but ``experts`` and ``expert_mlp`` gathered first.
    local_rules = {name: () for name in parallelism.rules}
    local_rules.update(experts=("expert",), expert_mlp=parallelism.rules["expert_mlp"])
    specs = jax.tree.map(lambda s: s.spec, tree_shardings(experts, Parallelism(parallelism.mesh, local_rules)))

    def local(x, chosen, weights, experts):
        count, top_k = chosen.shape
        slots, embed, local_experts = count * top_k, x.shape[1], experts.num_experts
        devices = jax.lax.axis_size("expert")
        flat = chosen.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        destination = flat[order] // local_experts
        sent = jnp.bincount(destination, length=devices)
        position = jnp.arange(slots) - (jnp.cumsum(sent) - sent)[destination]
        send = jnp.zeros((devices, slots, embed), x.dtype).at[destination, position].set(x[order // top_k])
        send_ids = jnp.full((devices, slots), local_experts, jnp.int32)
        send_ids = send_ids.at[destination, position].set(flat[order] - destination * local_experts)
        received = jax.lax.all_to_all(send, "expert", 0, 0)
        received_ids = jax.lax.all_to_all(send_ids, "expert", 0, 0).reshape(-1)
        down_bias = experts.down.bias if width_axes else None
        if down_bias is not None:  # every width shard would add it, and the sum count it once per shard
            experts = eqx.tree_at(lambda e: e.down.bias, experts, None)
        out = _local_experts(received.reshape(-1, embed), received_ids, experts)
        if width_axes:
            out = jax.lax.psum(out, width_axes)
        if down_bias is not None:
            bias = down_bias.reshape(local_experts, -1)[jnp.minimum(received_ids, local_experts - 1)]
            out = out + jnp.where((received_ids < local_experts)[:, None], bias, 0).astype(out.dtype)
        returned = jax.lax.all_to_all(out.reshape(devices, slots, embed), "expert", 0, 0)
        slot_outputs = jnp.zeros((slots, embed), out.dtype).at[order].set(returned[destination, position])
        combined = jnp.einsum("tk,tkd->td", weights, slot_outputs.reshape(count, top_k, embed))
        return combined.astype(x.dtype)

    run = jax.shard_map(local, mesh=parallelism.mesh, in_specs=(tokens, tokens, tokens, specs), out_specs=tokens)
    return run(x, routing.experts, routing.weights, experts)
