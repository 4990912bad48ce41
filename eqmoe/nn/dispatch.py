"""Expert-compute backends: given a routing, run the selected experts and combine their outputs.

Every backend computes ``y_t = sum_j weights[t, j] * expert_{experts[t, j]}(x_t)`` and differs only in
how the work is laid out. ``dense`` is the reference; the others must agree with it.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqmoe.nn._init import normal


class Experts(eqx.Module):
    """``num_experts`` SwiGLU experts stored as stacked weights."""

    w_gate: Float[Array, "experts embed expert_dim"]
    w_up: Float[Array, "experts embed expert_dim"]
    w_down: Float[Array, "experts expert_dim embed"]

    def __init__(
        self, num_experts: int, embed_dim: int, expert_dim: int, *, std: float, dtype: DTypeLike,
        key: PRNGKeyArray,
    ):
        k_gate, k_up, k_down = jax.random.split(key, 3)
        self.w_gate = normal(k_gate, (num_experts, embed_dim, expert_dim), std, dtype)
        self.w_up = normal(k_up, (num_experts, embed_dim, expert_dim), std, dtype)
        self.w_down = normal(k_down, (num_experts, expert_dim, embed_dim), std, dtype)


def dense(
    x: Float[Array, "tokens embed"],
    weights: Float[Array, "tokens k"],
    experts: Int[Array, "tokens k"],
    params: Experts,
    block_size: int,
) -> Float[Array, "tokens embed"]:
    """Every expert on every token, then a weighted sum: O(T * E) work, the numerical reference."""
    del block_size
    num_experts = params.w_gate.shape[0]
    hidden = jax.nn.silu(jnp.einsum("td,edf->etf", x, params.w_gate)) * jnp.einsum("td,edf->etf", x, params.w_up)
    outputs = jnp.einsum("etf,efd->etd", hidden, params.w_down)
    combine = jnp.zeros((x.shape[0], num_experts), weights.dtype)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], experts].add(weights)
    return jnp.einsum("te,etd->td", combine, outputs)


def sorted_blocks(
    x: Float[Array, "tokens embed"],
    weights: Float[Array, "tokens k"],
    experts: Int[Array, "tokens k"],
    params: Experts,
    block_size: int,
) -> Float[Array, "tokens embed"]:
    """Dropless grouped compute: sort the ``T*k`` token slots by expert, pad each expert's group to a
    multiple of ``block_size`` rows, and run one matmul per block with that block's expert weights.

    The padded layout has a static bound of ``T*k + E*(block_size - 1)`` rows (rounded up to whole
    blocks), so shapes never depend on the routing.
    """
    tokens, top_k = experts.shape
    num_experts = params.w_gate.shape[0]
    slots = tokens * top_k
    num_blocks = -(-(slots + num_experts * (block_size - 1)) // block_size)

    flat_experts = experts.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)
    sorted_experts = flat_experts[order]
    sorted_tokens = order // top_k
    sorted_weights = weights.reshape(-1)[order]

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

    hidden = jax.nn.silu(jnp.einsum("nbd,ndf->nbf", block_inputs, params.w_gate[block_experts]))
    hidden = hidden * jnp.einsum("nbd,ndf->nbf", block_inputs, params.w_up[block_experts])
    block_outputs = jnp.einsum("nbf,nfd->nbd", hidden, params.w_down[block_experts]).reshape(-1, x.shape[1])

    slot_outputs = block_outputs[rows] * sorted_weights[:, None]
    return jnp.zeros_like(x).at[sorted_tokens].add(slot_outputs)


Dispatch = Callable[..., Float[Array, "tokens embed"]]
BACKENDS: dict[str, Dispatch] = {"dense": dense, "sorted": sorted_blocks}


def resolve(name: str) -> Dispatch:
    """The backend called ``name``; ``"auto"`` is the fastest dropless one for the default platform."""
    if name == "auto":
        name = "sorted"
    if name not in BACKENDS:
        raise ValueError(f"unknown dispatch backend {name!r}; allowed: auto | {' | '.join(BACKENDS)}")
    return BACKENDS[name]
