"""Grouped expert SwiGLU over rows sorted by expert, with a hand-written backward pass.

The rows arrive as one ``[rows, embed]`` buffer in which expert ``e`` owns the ``group_rows[e]`` rows from
``group_start[e]`` on (both multiples of ``tile``; the layout pads each group). An outer ``lax.scan`` over
the experts takes one expert's weights at a time, and inner loops run that expert's rows in tiles:
as many ``wide``-row tiles as fit, then halving tiles down to ``tile`` rows for the rest, so rows go
through a few large, efficient matmuls while a group is padded by less than ``tile`` rows. Gate and up
projections are one ``[embed, 2 * expert_dim]`` matmul. Each expert's weights are read once per layer
(on XLA:CPU a weight slice taken inside a loop is a copy), and rows no expert owns (the tail of the static buffer) are
never visited and stay zero.

Why a custom VJP: differentiating the weight slice inside the loop would make JAX add a full
``[experts, embed, expert_dim]`` zero-padded gradient per tile. The backward pass mirrors the forward:
per expert, its tiles' weight gradients are summed in a local accumulator that becomes that expert's
row of the stacked gradient.

LoRA (:class:`RowAdapters`, built from :class:`eqmoe.nn.lora.ExpertAdapters` by :func:`fuse_adapters`)
adds rank-``r`` terms inside the same tiles: ``(x @ A_e) @ B_e`` beside ``x @ W_e``, never the merged
``W_e + A_e @ B_e``. The backward pass recomputes ``x @ A_e`` and ``hidden @ A_e`` (``tile x r``, cheap)
rather than keeping them, so LoRA adds no residual buffer; without adapters the program is the plain one.
"""

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eqmoe.nn.lora import ExpertAdapters


class RowAdapters(NamedTuple):
    """The kernel's form of the experts' LoRA factors, ``scale`` folded into the ``B`` factors.

    Gate and up share one input factor ``in_a = [A_gate | A_up]`` and a block-diagonal ``in_b`` whose
    columns are the fused ``gate | up`` pre-activations, so their adapters are two small matmuls like the
    fused weights' one. A side that is not adapted is ``None``."""

    in_a: Float[Array, "experts embed in_rank"] | None
    in_b: Float[Array, "experts in_rank gate_up"] | None
    down_a: Float[Array, "experts expert_dim down_rank"] | None
    down_b: Float[Array, "experts down_rank embed"] | None


def fuse_adapters(lora: ExpertAdapters) -> RowAdapters:
    """``lora`` as :class:`RowAdapters`. Plain array code, so autodiff splits the fused factors'
    gradients back into each adapter's (and drops the off-diagonal blocks of ``in_b``'s)."""
    sides = ((lora.gate_a, lora.gate_b, True), (lora.up_a, lora.up_b, False))
    pairs = [(a, b, is_gate) for a, b, is_gate in sides if a is not None]
    in_a = in_b = down_b = None
    if pairs:
        in_a = jnp.concatenate([a for a, _, _ in pairs], axis=2)
        in_b = jnp.concatenate([_in_columns(b, is_gate) for _, b, is_gate in pairs], axis=1) * lora.scale
    if lora.down_a is not None:
        down_b = lora.down_b * lora.scale
    return RowAdapters(in_a, in_b, lora.down_a, down_b)


def _in_columns(b: Float[Array, "experts rank expert_dim"], is_gate: bool) -> Float[Array, "experts rank gate_up"]:
    """``b`` in the gate (first) or up (second) half of the fused ``gate | up`` columns, zeros in the other."""
    zeros = jnp.zeros_like(b)
    return jnp.concatenate([b, zeros] if is_gate else [zeros, b], axis=2)


def _silu_and_grad(gate: Array) -> tuple[Array, Array]:
    """``silu(gate)`` and its derivative, both evaluated in float32 (as :func:`eqmoe.nn.mlp.silu`)."""
    g = gate.astype(jnp.float32)
    sigmoid = jax.nn.sigmoid(g)
    return (g * sigmoid).astype(gate.dtype), (sigmoid * (1 + g * (1 - sigmoid))).astype(jnp.float32)


def _over_tiles(start, size, tile: int, wide: int, body, carry):
    """``body(offset, rows, carry)`` over rows ``start .. start + size`` (a multiple of ``tile``): as many
    ``wide``-row tiles as fit, then at most one each of ``wide / 2, wide / 4, .., tile`` rows
    (``wide = tile * 2^m``), so every group runs in a few large matmuls whatever its size."""
    num_wide = size // wide
    carry = jax.lax.fori_loop(0, num_wide, lambda i, c: body(start + i * wide, wide, c), carry)
    done = num_wide * wide
    rows = wide // 2
    while rows >= tile:
        take = size - done >= rows
        carry = jax.lax.cond(take, partial(body, start + done, rows), lambda c: c, carry)
        done = done + jnp.where(take, rows, 0)
        rows //= 2
    return carry


def _take(x: Array, offset, rows: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, offset, rows, 0)


def _put(x: Array, update: Array, offset) -> Array:
    return jax.lax.dynamic_update_slice_in_dim(x, update.astype(x.dtype), offset, 0)


def _plus_low_rank(y: Array, x: Array, a: Array | None, b: Array | None) -> Array:
    """``y + (x @ a) @ b``, or ``y`` when that side has no adapter."""
    return y if a is None else y + (x @ a) @ b


@partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def grouped_swiglu(
    rows: Float[Array, "rows embed"],
    w_gate: Float[Array, "experts embed expert_dim"],
    w_up: Float[Array, "experts embed expert_dim"],
    w_down: Float[Array, "experts expert_dim embed"],
    group_start: Int[Array, " experts"],
    group_rows: Int[Array, " experts"],
    tile: int,
    wide: int,
    adapters: RowAdapters | None = None,
) -> Float[Array, "rows embed"]:
    """``down(silu(x @ gate) * (x @ up))`` of each row with its group's expert's weights (and their
    low-rank ``adapters``)."""
    return _forward(rows, w_gate, w_up, w_down, group_start, group_rows, tile, wide, adapters, keep_hidden=False)[0]


def _forward(rows, w_gate, w_up, w_down, group_start, group_rows, tile, wide, adapters, *, keep_hidden: bool):
    """The output rows and (with ``keep_hidden``, for the backward pass) every row's gate and up
    pre-activations. A loop cannot drop a buffer it carries, so inference does not carry one."""
    expert_dim = w_gate.shape[2]

    def expert(buffers, inputs):
        wg, wu, wd, start, size, lora = inputs
        w_gate_up = jnp.concatenate([wg, wu], axis=1)
        in_a, in_b, down_a, down_b = lora or (None,) * 4

        def run_tile(offset, count, buffers):
            x = _take(rows, offset, count)
            gate_up = _plus_low_rank(x @ w_gate_up, x, in_a, in_b)
            silu_gate, _ = _silu_and_grad(gate_up[:, :expert_dim])
            hidden = silu_gate * gate_up[:, expert_dim:]
            out = _put(buffers[0], _plus_low_rank(hidden @ wd, hidden, down_a, down_b), offset)
            return (out, _put(buffers[1], gate_up, offset)) if keep_hidden else (out,)

        return _over_tiles(start, size, tile, wide, run_tile, buffers), None

    init = (jnp.zeros_like(rows),)
    if keep_hidden:
        init += (jnp.zeros((rows.shape[0], 2 * expert_dim), rows.dtype),)
    buffers, _ = jax.lax.scan(expert, init, (w_gate, w_up, w_down, group_start, group_rows, adapters))
    return buffers


def _grouped_fwd(rows, w_gate, w_up, w_down, group_start, group_rows, tile, wide, adapters):
    out, gate_up = _forward(rows, w_gate, w_up, w_down, group_start, group_rows, tile, wide, adapters, keep_hidden=True)
    return out, (rows, gate_up, w_gate, w_up, w_down, group_start, group_rows, adapters)


def _adapter_grads(a, b, x, dy):
    """For ``y += (x @ a) @ b``: the gradient reaching ``x`` through the adapter and ``a``'s and ``b``'s
    (``None`` each when that side has no adapter)."""
    if a is None:
        return None, None, None
    dy_b = dy @ b.T  # [rows, rank]: every adapter gradient goes through this small product
    return dy_b @ a.T, x.T @ dy_b, (x @ a).T @ dy


def _plus(y: Array | None, extra: Array | None) -> Array | None:
    """``y + extra``, or ``y`` when there is no ``extra`` (a side without adapter)."""
    return y if extra is None else y + extra


def _grouped_bwd(tile, wide, residuals, d_out):
    rows, gate_up, w_gate, w_up, w_down, group_start, group_rows, adapters = residuals
    expert_dim = w_gate.shape[2]

    def expert(d_rows, inputs):
        wg, wu, wd, start, size, lora = inputs
        w_gate_up = jnp.concatenate([wg, wu], axis=1)
        in_a, in_b, down_a, down_b = lora or (None,) * 4

        def run_tile(offset, count, carry):
            d_rows, d_w_gate_up, d_wd, d_lora = carry
            x, dy, h = _take(rows, offset, count), _take(d_out, offset, count), _take(gate_up, offset, count)
            g, u = h[:, :expert_dim], h[:, expert_dim:]
            silu_gate, silu_grad = _silu_and_grad(g)
            hidden = silu_gate * u
            d_hidden_lora, d_down_a, d_down_b = _adapter_grads(down_a, down_b, hidden, dy)
            d_hidden = _plus(dy @ wd.T, d_hidden_lora)
            d_g = (d_hidden.astype(jnp.float32) * u.astype(jnp.float32) * silu_grad).astype(g.dtype)
            d_gate_up = jnp.concatenate([d_g, d_hidden * silu_gate], axis=1)
            d_x_lora, d_in_a, d_in_b = _adapter_grads(in_a, in_b, x, d_gate_up)
            d_rows = _put(d_rows, _plus(d_gate_up @ w_gate_up.T, d_x_lora), offset)
            if d_lora is not None:
                d_lora = RowAdapters(*map(_plus, d_lora, (d_in_a, d_in_b, d_down_a, d_down_b)))
            return d_rows, d_w_gate_up + x.T @ d_gate_up, d_wd + hidden.T @ dy, d_lora

        d_lora = None if lora is None else jax.tree.map(jnp.zeros_like, lora)
        init = (d_rows, jnp.zeros_like(w_gate_up), jnp.zeros_like(wd), d_lora)
        d_rows, d_w_gate_up, d_wd, d_lora = _over_tiles(start, size, tile, wide, run_tile, init)
        return d_rows, (d_w_gate_up[:, :expert_dim], d_w_gate_up[:, expert_dim:], d_wd, d_lora)

    d_rows, (d_gate_w, d_up_w, d_down_w, d_adapters) = jax.lax.scan(
        expert, jnp.zeros_like(rows), (w_gate, w_up, w_down, group_start, group_rows, adapters)
    )
    return d_rows, d_gate_w, d_up_w, d_down_w, None, None, d_adapters


grouped_swiglu.defvjp(_grouped_fwd, _grouped_bwd)
