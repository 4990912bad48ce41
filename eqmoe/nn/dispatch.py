"""Expert-compute backends: given a routing, run the selected experts and combine their outputs.

Every backend computes ``y_t = sum_j weights[t, j] * expert_{experts[t, j]}(x_t)`` (a dropped
assignment has weight 0) and differs only in how the work is laid out. ``dense`` is the reference;
the others must agree with it. Signature: ``backend(x, routing, experts, config) -> y``.

With LoRA (``Experts.lora``) every backend adds each adapted matrix's ``scale * (x @ A_e) @ B_e`` beside
``x @ W_e``, as rank-``r`` products in its own layout: a merged ``W_e + scale * A_e @ B_e`` would be a
full copy of the expert weights per step, and its gradient a full ``[experts, embed, expert_mlp]`` array.

Every backend is registered in :data:`BACKENDS` as a :class:`Backend`: the function, the planner's
activation estimate (:mod:`eqmoe.analysis.plan` reads it, so a new backend is planned by its own formula,
never another's) and an optional config check. ``MoEConfig.dispatch`` accepts the registered names and
``"auto"``, a resolution rule (:func:`backend_name`).
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqmoe.config import MoEConfig
from eqmoe.nn._init import Init
from eqmoe.nn._params import Layer, Role, param
from eqmoe.nn.grouped import fuse_adapters, grouped_swiglu
from eqmoe.nn.lora import ExpertAdapters
from eqmoe.nn.mlp import silu
from eqmoe.nn.router import Routing, expert_capacity
from eqmoe.registry import Registry


class Experts(Layer):
    """``num_experts`` SwiGLU experts stored as stacked weights, with optional per-expert LoRA."""

    w_gate: Float[Array, "experts embed expert_mlp"] = param(Role.EXPERT)
    w_up: Float[Array, "experts embed expert_mlp"] = param(Role.EXPERT)
    w_down: Float[Array, "experts expert_mlp embed"] = param(Role.EXPERT)
    lora: ExpertAdapters | None

    def __init__(
        self,
        num_experts: int,
        embed_dim: int,
        expert_dim: int,
        *,
        init: Init,
        key: PRNGKeyArray,
        lora: ExpertAdapters | None = None,
    ):
        k_gate, k_up, k_down = jax.random.split(key, 3)
        self.w_gate = init.weight(k_gate, (num_experts, embed_dim, expert_dim), fan_in=embed_dim)
        self.w_up = init.weight(k_up, (num_experts, embed_dim, expert_dim), fan_in=embed_dim)
        self.w_down = init.weight(k_down, (num_experts, expert_dim, embed_dim), fan_in=expert_dim)
        self.lora = lora


def _factors(lora: ExpertAdapters | None, name: str) -> tuple[Array, Array] | None:
    """The ``(A, B)`` adapter of matrix ``name`` (``gate``, ``up`` or ``down``), ``None`` if not adapted."""
    a = None if lora is None else getattr(lora, f"{name}_a")
    return None if a is None else (a, getattr(lora, f"{name}_b"))


def expert_einsum(spec: str, x: Array, weight: Array, lora: ExpertAdapters | None, name: str) -> Array:
    """``einsum(spec, x, weight)`` plus matrix ``name``'s adapter term ``scale * (x @ A_e) @ B_e``.

    ``spec`` is the weight product, its weight operand lettered ``expert, input, output``
    (``"td,edf->etf"``); the adapter runs it with the output letter replaced by a rank ``r``, then
    contracts ``r`` with ``B``."""
    out = jnp.einsum(spec, x, weight)
    factors = _factors(lora, name)
    if factors is None:
        return out
    operands, result = spec.split("->")
    x_letters, (e, i, o) = operands.split(",")
    rank_result = result.replace(o, "r")
    x_a = jnp.einsum(f"{x_letters},{e}{i}r->{rank_result}", x, factors[0])
    return out + jnp.einsum(f"{rank_result},{e}r{o}->{result}", x_a, factors[1]) * lora.scale


def ragged_matmul(
    x: Float[Array, "rows fan_in"],
    weight: Float[Array, "experts fan_in fan_out"],
    group_sizes: Int[Array, " experts"],
    lora: ExpertAdapters | None,
    name: str,
) -> Float[Array, "rows fan_out"]:
    """``ragged_dot(x, weight)`` plus matrix ``name``'s adapter term, two ragged products over the same
    groups: ``x @ A_e`` (rank ``r``), then ``@ B_e``."""
    out = jax.lax.ragged_dot(x, weight, group_sizes)
    factors = _factors(lora, name)
    if factors is None:
        return out
    x_a = jax.lax.ragged_dot(x, factors[0], group_sizes)
    return out + jax.lax.ragged_dot(x_a, factors[1], group_sizes) * lora.scale


def dense(
    x: Float[Array, "tokens embed"], routing: Routing, params: Experts, config: MoEConfig
) -> Float[Array, "tokens embed"]:
    """Every expert on every token, then a weighted sum: O(T * E) work, the numerical reference."""
    tokens, num_experts, lora = x.shape[0], params.w_gate.shape[0], params.lora
    gate = expert_einsum("td,edf->etf", x, params.w_gate, lora, "gate")
    hidden = silu(gate) * expert_einsum("td,edf->etf", x, params.w_up, lora, "up")
    outputs = expert_einsum("etf,efd->etd", hidden, params.w_down, lora, "down")
    combine = jnp.zeros((tokens, num_experts), routing.weights.dtype)
    combine = combine.at[jnp.arange(tokens)[:, None], routing.experts].add(routing.weights)
    return jnp.einsum("te,etd->td", combine, outputs)


class BlockLayout(NamedTuple):
    """Where each token slot goes when the slots are sorted by expert and every expert's group is padded
    to whole blocks: ``slot_rows[t, j]`` is the row of token ``t``'s ``j``-th slot, ``row_slots[r]`` the
    slot ``t * top_k + j`` in row ``r`` (``tokens * top_k`` for padding), and expert ``e`` owns the
    ``group_rows[e]`` rows from ``group_start[e]`` on."""

    slot_rows: Int[Array, "tokens top_k"]
    row_slots: Int[Array, " rows"]
    group_start: Int[Array, " experts"]
    group_rows: Int[Array, " experts"]


def block_layout(experts: Int[Array, "tokens top_k"], num_experts: int, block_size: int) -> BlockLayout:
    """The :class:`BlockLayout` of a routing. Its static size is ``tokens * top_k + num_experts *
    (block_size - 1)`` rows rounded up to whole blocks, so shapes never depend on the routing."""
    tokens, top_k = experts.shape
    slots = tokens * top_k
    num_rows = -(-(slots + num_experts * (block_size - 1)) // block_size) * block_size
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_experts = flat[order]
    group_sizes = jnp.bincount(flat, length=num_experts)
    padded_sizes = -(-group_sizes // block_size) * block_size
    padded_starts = jnp.cumsum(padded_sizes) - padded_sizes
    group_starts = jnp.cumsum(group_sizes) - group_sizes
    sorted_rows = padded_starts[sorted_experts] + jnp.arange(slots) - group_starts[sorted_experts]
    return BlockLayout(
        slot_rows=jnp.zeros(slots, jnp.int32).at[order].set(sorted_rows).reshape(tokens, top_k),
        row_slots=jnp.full(num_rows, slots, jnp.int32).at[sorted_rows].set(order),
        group_start=padded_starts.astype(jnp.int32),
        group_rows=padded_sizes.astype(jnp.int32),
    )


# Rows per tile when an expert has that many: larger matmuls run faster per FLOP on CPU, while groups
# are padded only to ``block_size`` (measured on 2 cores: block 64 with tiles up to 512 rows beat 128 or 256
# alone).
_WIDE_TILE_ROWS = 512


@jax.custom_vjp
def _slot_rows_of(x: Float[Array, "tokens embed"], layout: BlockLayout) -> Float[Array, "rows embed"]:
    """Row ``r`` holds the token of slot ``row_slots[r]`` (zeros for padding).

    Both this gather and :func:`_slots_of` are permutations plus padding, so each one's gradient is
    the other gather; written out, XLA:CPU would scatter-add instead, which runs far slower."""
    top_k = layout.slot_rows.shape[1]
    return jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[layout.row_slots // top_k]


def _slot_rows_fwd(x, layout):
    return _slot_rows_of(x, layout), layout


def _slot_rows_bwd(layout, d_rows):
    return d_rows[layout.slot_rows].sum(axis=1), None


_slot_rows_of.defvjp(_slot_rows_fwd, _slot_rows_bwd)


@jax.custom_vjp
def _slots_of(rows: Float[Array, "rows embed"], layout: BlockLayout) -> Float[Array, "tokens top_k embed"]:
    """Slot ``(t, j)`` reads row ``slot_rows[t, j]``."""
    return rows[layout.slot_rows]


def _slots_fwd(rows, layout):
    return _slots_of(rows, layout), layout


def _slots_bwd(layout, d_slots):
    flat = d_slots.reshape(-1, d_slots.shape[2])
    return jnp.concatenate([flat, jnp.zeros((1, flat.shape[1]), flat.dtype)])[layout.row_slots], None


_slots_of.defvjp(_slots_fwd, _slots_bwd)


def sorted_blocks(
    x: Float[Array, "tokens embed"], routing: Routing, params: Experts, config: MoEConfig
) -> Float[Array, "tokens embed"]:
    """Dropless grouped compute: gather the ``T*k`` token slots into expert-sorted groups padded to
    ``block_size`` rows (:func:`block_layout`), run each group with its expert's weights
    (:func:`eqmoe.nn.grouped.grouped_swiglu`), and gather each token's ``k`` outputs back.

    Memory is linear in ``T``: the largest intermediates are ``[rows, embed]`` and ``[rows, 2 * expert_dim]``.
    """
    layout = block_layout(routing.experts, params.w_gate.shape[0], config.block_size)
    rows = _slot_rows_of(x, layout)
    tile = config.block_size
    wide = tile
    while wide * 2 <= min(_WIDE_TILE_ROWS, rows.shape[0]):
        wide *= 2
    adapters = None if params.lora is None else fuse_adapters(params.lora)
    out = grouped_swiglu(
        rows, params.w_gate, params.w_up, params.w_down, layout.group_start, layout.group_rows, tile, wide, adapters
    )
    return jnp.einsum("tk,tkd->td", routing.weights, _slots_of(out, layout)).astype(x.dtype)


def ragged(
    x: Float[Array, "tokens embed"], routing: Routing, params: Experts, config: MoEConfig
) -> Float[Array, "tokens embed"]:
    """Dropless grouped compute with ``jax.lax.ragged_dot``: the ``T*k`` slots sorted by expert with no
    padding, one ragged matmul per weight. The kernel XLA provides on GPU and TPU (slow on XLA:CPU)."""
    tokens, top_k = routing.experts.shape
    flat = routing.experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=params.w_gate.shape[0]).astype(jnp.int32)
    slots, lora = x[order // top_k], params.lora
    hidden = silu(ragged_matmul(slots, params.w_gate, group_sizes, lora, "gate"))
    hidden = hidden * ragged_matmul(slots, params.w_up, group_sizes, lora, "up")
    out = ragged_matmul(hidden, params.w_down, group_sizes, lora, "down")
    sorted_position = jnp.zeros_like(order).at[order].set(jnp.arange(order.size))
    slot_outputs = out[sorted_position].reshape(tokens, top_k, -1)
    return jnp.einsum("tk,tkd->td", routing.weights, slot_outputs).astype(x.dtype)


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
    lora = params.lora
    hidden = silu(expert_einsum("egcd,edf->egcf", buffers, params.w_gate, lora, "gate"))
    hidden = hidden * expert_einsum("egcd,edf->egcf", buffers, params.w_up, lora, "up")
    outputs = expert_einsum("egcf,efd->egcd", hidden, params.w_down, lora, "down")
    return jnp.einsum("gsec,egcd->gsd", combine, outputs).reshape(x.shape)


# --- the registry: MoEConfig.dispatch -> Backend -----------------------------------------------------------

Dispatch = Callable[..., Float[Array, "tokens embed"]]
Estimate = Callable[[MoEConfig, int, int, int, int], float]


class Backend(NamedTuple):
    """A registered dispatch backend.

    **Arguments:**

    - `run`: ``run(x, routing, experts, config) -> y`` (see the module docstring).
    - `estimate`: ``estimate(config, tokens, embed_dim, expert_dim, c) -> bytes``, the planner's model of
      the activations one MoE layer's expert compute keeps per token for the backward pass (on top of the
      routing's), given ``tokens`` tokens per device, the model width, the expert width (already divided
      over the ``tensor`` axis) and ``c`` bytes per compute-dtype element.
    - `check`: optional ``check(config)`` that ``MoEConfig.__post_init__`` runs when the backend is named
      there, raising ``ValueError`` for a config the backend cannot run.
    """

    run: Dispatch
    estimate: Estimate
    check: Callable[[MoEConfig], None] | None = None


def _dense_bytes(config: MoEConfig, tokens: int, d: int, f: int, c: int) -> float:
    """Every expert's hidden activations and output for every token."""
    return float(c * config.router.num_experts * (2 * d + 3 * f))


def _sorted_bytes(config: MoEConfig, tokens: int, d: int, f: int, c: int) -> float:
    """The expert-sorted rows, padded per expert to ``block_size``, and the ``k`` gathered outputs."""
    block, k, experts = config.block_size, config.router.top_k, config.router.num_experts
    rows = -(-(tokens * k + experts * (block - 1)) // block) * block / tokens
    return float(c * (rows * (2 * d + 2 * f) + k * d))


def _ragged_bytes(config: MoEConfig, tokens: int, d: int, f: int, c: int) -> float:
    """The ``T*k`` sorted slots, no padding."""
    return float(c * config.router.top_k * (2 * d + 3 * f))


def _capacity_bytes(config: MoEConfig, tokens: int, d: int, f: int, c: int) -> float:
    """One-hot dispatch and combine tensors ``[tokens, E, C]`` and their products (four live), then the
    ``[E, G, C]`` expert buffers."""
    router = config.router
    experts, groups = router.num_experts, router.num_groups
    slots = expert_capacity(tokens // groups, experts, router.capacity_factor)
    buffers = experts * slots * groups * (2 * d + 3 * f) / tokens
    return float(c * 4 * experts * slots + c * buffers)


def _needs_capacity_factor(config: MoEConfig) -> None:
    if config.router.capacity_factor is None:
        allowed = " | ".join(name for name in (*BACKENDS.names(), "auto") if name != "capacity")
        raise ValueError(
            f"MoEConfig.dispatch={config.dispatch!r} is invalid; allowed: {allowed} when router.capacity_factor is None"
        )


BACKENDS: Registry[Backend] = Registry("dispatch backend")
BACKENDS.register("dense", Backend(dense, _dense_bytes))
BACKENDS.register("sorted", Backend(sorted_blocks, _sorted_bytes))
BACKENDS.register("ragged_dot", Backend(ragged, _ragged_bytes))
BACKENDS.register("capacity", Backend(capacity, _capacity_bytes, check=_needs_capacity_factor))


def backend_name(config: MoEConfig) -> str:
    """The registered backend ``config.dispatch`` names. ``"auto"`` is ``capacity`` for capacity routing,
    otherwise ``sorted`` on CPU (where ``ragged_dot`` is emulated slowly) and ``ragged_dot`` on GPU and TPU."""
    name = config.dispatch
    if name == "auto":
        if config.router.capacity_factor is not None:
            return "capacity"
        return "sorted" if jax.default_backend() == "cpu" else "ragged_dot"
    BACKENDS.get(name)  # an unregistered name raises, naming the allowed ones
    return name


def resolve(config: MoEConfig) -> Dispatch:
    """The function of the backend ``config.dispatch`` resolves to (see :func:`backend_name`)."""
    return BACKENDS.get(backend_name(config)).run
