"""Expert-compute backends: given a routing, run the selected experts and combine their outputs.

Every backend computes ``y_t = sum_j weights[t, j] * expert_{experts[t, j]}(x_t)`` (a dropped
assignment has weight 0) and differs only in how the work is laid out. ``dense`` is the reference;
the others must agree with it. Signature: ``backend(x, routing, experts, config) -> y``, ``experts`` a
:class:`eqmoe.nn.experts.RoutedExperts` whose products the backend calls in its own layout (one matrix per
expert, rows grouped by expert, per-expert buffers); biases and LoRA adapters ride inside those products, as
rank-``r`` terms beside ``x @ W_e`` (a merged ``W_e + scale * A_e @ B_e`` would be a full copy of the expert
weights per step, and its gradient a full ``[experts, embed, expert_mlp]`` array).

Every backend is registered in :data:`eqmoe.registries.DISPATCH_BACKENDS` as a :class:`Backend`: the function,
the planner's activation estimate (:mod:`eqmoe.analysis.plan` reads it, so a new backend is planned by its own
formula, never another's) and an optional config check. ``MoEConfig.dispatch`` accepts the registered names and
``"auto"``, a resolution rule (:func:`backend_name`).
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eqmoe.config import MoEConfig
from eqmoe.nn import megablox
from eqmoe.nn.experts import RoutedExperts
from eqmoe.nn.grouped import grouped_experts
from eqmoe.nn.router import Routing, expert_capacity
from eqmoe.registries import DISPATCH_BACKENDS


def dense(
    x: Float[Array, "tokens embed"], routing: Routing, experts: RoutedExperts, config: MoEConfig
) -> Float[Array, "tokens embed"]:
    """Every expert on every token, then a weighted sum: O(T * E) work, the numerical reference."""
    tokens = x.shape[0]
    outputs = experts.apply(x, lambda w, rows: w.shared_input(rows), lambda w, hidden: w.per_expert(hidden))
    combine = jnp.zeros((tokens, experts.num_experts), routing.weights.dtype)
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
    the other gather; written out, XLA would scatter-add instead, which runs far slower on a CPU and a TPU."""
    top_k = layout.slot_rows.shape[1]
    # a padding row's slot is past the last token: filled with zeros by the gather, no padded copy of x
    return jnp.take(x, layout.row_slots // top_k, axis=0, mode="fill", fill_value=0)


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
    return jnp.take(flat, layout.row_slots, axis=0, mode="fill", fill_value=0), None


_slots_of.defvjp(_slots_fwd, _slots_bwd)


def sorted_blocks(
    x: Float[Array, "tokens embed"], routing: Routing, experts: RoutedExperts, config: MoEConfig
) -> Float[Array, "tokens embed"]:
    """Dropless grouped compute: gather the ``T*k`` token slots into expert-sorted groups padded to
    ``block_size`` rows (:func:`block_layout`), run each group with its expert
    (:func:`eqmoe.nn.grouped.grouped_experts`), and gather each token's ``k`` outputs back.

    Memory is linear in ``T``: the largest intermediates are ``[rows, embed]`` and ``[rows, 2 * expert_dim]``.
    """
    layout = block_layout(routing.experts, experts.num_experts, config.block_size)
    rows = _slot_rows_of(x, layout)
    tile = config.block_size
    wide = tile
    while wide * 2 <= min(_WIDE_TILE_ROWS, rows.shape[0]):
        wide *= 2
    out = grouped_experts(rows, experts, layout.group_start, layout.group_rows, tile, wide)
    return jnp.einsum("tk,tkd->td", routing.weights, _slots_of(out, layout)).astype(x.dtype)


def sorted_by_expert(experts: Int[Array, "tokens top_k"], num_experts: int) -> tuple[Array, Array, Array]:
    """``(order, group_sizes, sorted_position)``: the slots ``t * top_k + j`` sorted by expert (stable), how many
    each expert has, and where each slot landed."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    # the inverse permutation by a second sort rather than a scatter, which a TPU runs slowly
    sorted_position = jnp.argsort(order)
    return order, group_sizes, sorted_position


def sorted_layout(experts: Int[Array, "tokens top_k"], num_experts: int, num_rows: int) -> BlockLayout:
    """The slots sorted by expert with no padding between groups (``group_rows`` their sizes), then
    ``num_rows - tokens * top_k`` rows of padding: the layout of one grouped kernel over all experts."""
    order, group_sizes, sorted_position = sorted_by_expert(experts, num_experts)
    slots = order.size
    return BlockLayout(
        slot_rows=sorted_position.reshape(experts.shape).astype(jnp.int32),
        row_slots=jnp.concatenate([order, jnp.full(num_rows - slots, slots, order.dtype)]).astype(jnp.int32),
        group_start=(jnp.cumsum(group_sizes) - group_sizes).astype(jnp.int32),
        group_rows=group_sizes,
    )


def ragged(
    x: Float[Array, "tokens embed"], routing: Routing, experts: RoutedExperts, config: MoEConfig
) -> Float[Array, "tokens embed"]:
    """Dropless grouped compute with ``jax.lax.ragged_dot``: the ``T*k`` slots sorted by expert with no
    padding, one ragged matmul per weight. The kernel XLA provides on GPU and TPU (slow on XLA:CPU)."""
    layout = sorted_layout(routing.experts, experts.num_experts, routing.experts.size)
    product = lambda w, rows: w.ragged(rows, layout.group_rows)  # noqa: E731
    out = experts.apply(_slot_rows_of(x, layout), product, product)
    return jnp.einsum("tk,tkd->td", routing.weights, _slots_of(out, layout)).astype(x.dtype)


def grouped_matmul(
    x: Float[Array, "tokens embed"], routing: Routing, experts: RoutedExperts, config: MoEConfig
) -> Float[Array, "tokens embed"]:
    """Dropless grouped compute with the TPU's grouped-matmul kernel (:mod:`eqmoe.nn.megablox`): the ``T*k`` slots
    sorted by expert, padded once to whole row tiles of ``config.tiles``, one kernel call per weight. Tokens move
    into and out of expert order by gathers both ways (their gradients too: a TPU scatters slowly)."""
    slots = routing.experts.size
    layout = sorted_layout(routing.experts, experts.num_experts, megablox.padded_rows(slots, config.tiles))
    product = lambda w, rows: w.grouped(rows, layout.group_rows, config.tiles)  # noqa: E731
    out = experts.apply(_slot_rows_of(x, layout), product, product)
    return jnp.einsum("tk,tkd->td", routing.weights, _slots_of(out, layout)).astype(x.dtype)


def capacity(
    x: Float[Array, "tokens embed"], routing: Routing, experts: RoutedExperts, config: MoEConfig
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
    product = lambda w, rows: w.per_expert(rows)  # noqa: E731
    outputs = experts.apply(buffers.reshape(num_experts, groups * slots, -1), product, product)
    outputs = outputs.reshape(num_experts, groups, slots, -1)
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
    - `platforms`: where the backend is fast enough for ``auto`` to time it (``None``: everywhere); elsewhere it
      still runs when named (a TPU kernel in Pallas interpret mode, for checking).
    """

    run: Dispatch
    estimate: Estimate
    check: Callable[[MoEConfig], None] | None = None
    platforms: tuple[str, ...] | None = None


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


def _grouped_matmul_bytes(config: MoEConfig, tokens: int, d: int, f: int, c: int) -> float:
    """The ``T*k`` sorted slots padded to whole row tiles."""
    slots = tokens * config.router.top_k
    return float(c * megablox.padded_rows(slots, config.tiles) / tokens * (2 * d + 3 * f))


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


BACKENDS = DISPATCH_BACKENDS
BACKENDS.register("dense", Backend(dense, _dense_bytes))
BACKENDS.register("sorted", Backend(sorted_blocks, _sorted_bytes))
BACKENDS.register("ragged_dot", Backend(ragged, _ragged_bytes))
BACKENDS.register("capacity", Backend(capacity, _capacity_bytes, check=_needs_capacity_factor))
BACKENDS.register("gmm", Backend(grouped_matmul, _grouped_matmul_bytes, platforms=megablox.PLATFORMS))


def backend_name(config: MoEConfig) -> str:
    """The registered backend ``config.dispatch`` names. ``"auto"`` is ``capacity`` for capacity routing,
    otherwise ``sorted`` on CPU (where ``ragged_dot`` is emulated slowly), ``gmm`` on TPU and ``ragged_dot`` on
    GPU."""
    name = config.dispatch
    if name == "auto":
        if config.router.capacity_factor is not None:
            return "capacity"
        platform = jax.default_backend()
        return {"cpu": "sorted", **dict.fromkeys(megablox.PLATFORMS, "gmm")}.get(platform, "ragged_dot")
    BACKENDS.get(name)  # an unregistered name raises, naming the allowed ones
    return name


def resolve(config: MoEConfig) -> Dispatch:
    """The function of the backend ``config.dispatch`` resolves to (see :func:`backend_name`)."""
    return BACKENDS.get(backend_name(config)).run
