"""Expert-compute backends: given a routing, run the selected experts and combine their outputs.

Every backend computes ``y_t = sum_j weights[t, j] * expert_{experts[t, j]}(x_t)`` (a dropped
assignment has weight 0) and differs only in how the work is laid out. ``dense`` is the reference;
the others must agree with it. Signature: ``backend(x, routing, experts, config) -> y``.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from eqmoe.config import MoEConfig
from eqmoe.nn._init import Init
from eqmoe.nn.mlp import silu
from eqmoe.nn.router import Routing, expert_capacity


class Experts(eqx.Module):
    """``num_experts`` SwiGLU experts stored as stacked weights."""

    w_gate: Float[Array, "experts embed expert_dim"]
    w_up: Float[Array, "experts embed expert_dim"]
    w_down: Float[Array, "experts expert_dim embed"]

    def __init__(self, num_experts: int, embed_dim: int, expert_dim: int, *, init: Init, key: PRNGKeyArray):
        k_gate, k_up, k_down = jax.random.split(key, 3)
        self.w_gate = init.weight(k_gate, (num_experts, embed_dim, expert_dim), fan_in=embed_dim)
        self.w_up = init.weight(k_up, (num_experts, embed_dim, expert_dim), fan_in=embed_dim)
        self.w_down = init.weight(k_down, (num_experts, expert_dim, embed_dim), fan_in=expert_dim)


def dense(
    x: Float[Array, "tokens embed"], routing: Routing, params: Experts, config: MoEConfig
) -> Float[Array, "tokens embed"]:
    """Every expert on every token, then a weighted sum: O(T * E) work, the numerical reference."""
    tokens, num_experts = x.shape[0], params.w_gate.shape[0]
    hidden = silu(jnp.einsum("td,edf->etf", x, params.w_gate)) * jnp.einsum("td,edf->etf", x, params.w_up)
    outputs = jnp.einsum("etf,efd->etd", hidden, params.w_down)
    combine = jnp.zeros((tokens, num_experts), routing.weights.dtype)
    combine = combine.at[jnp.arange(tokens)[:, None], routing.experts].add(routing.weights)
    return jnp.einsum("te,etd->td", combine, outputs)


def sorted_blocks(
    x: Float[Array, "tokens embed"], routing: Routing, params: Experts, config: MoEConfig
) -> Float[Array, "tokens embed"]:
    """Dropless grouped compute: sort the ``T*k`` token slots by expert, pad each expert's group to a
    multiple of ``block_size`` rows, and run one matmul per block with that block's expert weights.

    The padded layout has a static bound of ``T*k + E*(block_size - 1)`` rows (rounded up to whole
    blocks), so shapes never depend on the routing.
    """
    block_size = config.block_size
    tokens, top_k = routing.experts.shape
    num_experts = params.w_gate.shape[0]
    slots = tokens * top_k
    num_blocks = -(-(slots + num_experts * (block_size - 1)) // block_size)

    flat_experts = routing.experts.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)
    sorted_experts = flat_experts[order]
    sorted_tokens = order // top_k
    sorted_weights = routing.weights.reshape(-1)[order]

    group_sizes = jnp.bincount(flat_experts, length=num_experts)
    padded_sizes = -(-group_sizes // block_size) * block_size
    group_starts = jnp.cumsum(group_sizes) - group_sizes
    padded_ends = jnp.cumsum(padded_sizes)
    padded_starts = padded_ends - padded_sizes
    rows = padded_starts[sorted_experts] + jnp.arange(slots) - group_starts[sorted_experts]

    block_inputs = jnp.zeros((num_blocks * block_size, x.shape[1]), x.dtype).at[rows].set(x[sorted_tokens])
    block_inputs = block_inputs.reshape(num_blocks, block_size, -1)
    block_starts = jnp.arange(num_blocks) * block_size
    block_experts = jnp.minimum(jnp.searchsorted(padded_ends, block_starts, side="right"), num_experts - 1)

    hidden = silu(jnp.einsum("nbd,ndf->nbf", block_inputs, params.w_gate[block_experts]))
    hidden = hidden * jnp.einsum("nbd,ndf->nbf", block_inputs, params.w_up[block_experts])
    block_outputs = jnp.einsum("nbf,nfd->nbd", hidden, params.w_down[block_experts]).reshape(-1, x.shape[1])

    slot_outputs = block_outputs[rows] * sorted_weights[:, None]
    return jnp.zeros_like(x).at[sorted_tokens].add(slot_outputs)


def capacity(
    x: Float[Array, "tokens embed"], routing: Routing, params: Experts, config: MoEConfig
) -> Float[Array, "tokens embed"]:
    """GShard dispatch: one-hot ``[groups, S, E, C]`` dispatch and combine tensors move tokens into
    per-expert buffers of ``C`` slots and back (AXLearn's MoE layer). Needs a capacity factor."""
    router = config.router
    if router.capacity_factor is None:
        raise ValueError("dispatch='capacity' needs RouterConfig.capacity_factor (None means dropless)")
    groups, num_experts = router.num_groups, router.num_experts
    size = x.shape[0] // groups
    slots = expert_capacity(size, num_experts, router.capacity_factor)
    to_expert = jax.nn.one_hot(routing.experts, num_experts, dtype=x.dtype) * routing.kept[..., None]
    to_slot = jax.nn.one_hot(routing.positions, slots, dtype=x.dtype)  # all zeros past the capacity
    dispatch_mask = jnp.einsum("tke,tkc->tec", to_expert, to_slot).reshape(groups, size, num_experts, slots)
    combine = jnp.einsum("tke,tkc,tk->tec", to_expert, to_slot, routing.weights)
    combine = combine.reshape(groups, size, num_experts, slots)

    buffers = jnp.einsum("gsec,gsd->egcd", dispatch_mask, x.reshape(groups, size, -1))
    hidden = silu(jnp.einsum("egcd,edf->egcf", buffers, params.w_gate))
    hidden = hidden * jnp.einsum("egcd,edf->egcf", buffers, params.w_up)
    outputs = jnp.einsum("egcf,efd->egcd", hidden, params.w_down)
    return jnp.einsum("gsec,egcd->gsd", combine, outputs).reshape(x.shape)


Dispatch = Callable[..., Float[Array, "tokens embed"]]
BACKENDS: dict[str, Dispatch] = {"dense": dense, "sorted": sorted_blocks, "capacity": capacity}


def resolve(config: MoEConfig) -> Dispatch:
    """The configured backend; ``"auto"`` is ``capacity`` for capacity routing, else ``sorted``."""
    name = config.dispatch
    if name == "auto":
        name = "sorted" if config.router.capacity_factor is None else "capacity"
    if name not in BACKENDS:
        raise ValueError(f"unknown dispatch backend {name!r}; allowed: auto | {' | '.join(BACKENDS)}")
    return BACKENDS[name]
