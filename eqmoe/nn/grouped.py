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
"""

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


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
) -> Float[Array, "rows embed"]:
    """``down(silu(x @ gate) * (x @ up))`` of each row with its group's expert's weights."""
    return _forward(rows, w_gate, w_up, w_down, group_start, group_rows, tile, wide, keep_hidden=False)[0]


def _forward(rows, w_gate, w_up, w_down, group_start, group_rows, tile, wide, *, keep_hidden: bool):
    """The output rows and (with ``keep_hidden``, for the backward pass) every row's gate and up
    pre-activations. A loop cannot drop a buffer it carries, so inference does not carry one."""
    expert_dim = w_gate.shape[2]

    def expert(buffers, inputs):
        wg, wu, wd, start, size = inputs
        w_gate_up = jnp.concatenate([wg, wu], axis=1)

        def run_tile(offset, count, buffers):
            gate_up = _take(rows, offset, count) @ w_gate_up
            silu_gate, _ = _silu_and_grad(gate_up[:, :expert_dim])
            out = _put(buffers[0], (silu_gate * gate_up[:, expert_dim:]) @ wd, offset)
            return (out, _put(buffers[1], gate_up, offset)) if keep_hidden else (out,)

        return _over_tiles(start, size, tile, wide, run_tile, buffers), None

    init = (jnp.zeros_like(rows),)
    if keep_hidden:
        init += (jnp.zeros((rows.shape[0], 2 * expert_dim), rows.dtype),)
    buffers, _ = jax.lax.scan(expert, init, (w_gate, w_up, w_down, group_start, group_rows))
    return buffers


def _grouped_fwd(rows, w_gate, w_up, w_down, group_start, group_rows, tile, wide):
    out, gate_up = _forward(rows, w_gate, w_up, w_down, group_start, group_rows, tile, wide, keep_hidden=True)
    return out, (rows, gate_up, w_gate, w_up, w_down, group_start, group_rows)


def _grouped_bwd(tile, wide, residuals, d_out):
    rows, gate_up, w_gate, w_up, w_down, group_start, group_rows = residuals
    expert_dim = w_gate.shape[2]

    def expert(d_rows, inputs):
        wg, wu, wd, start, size = inputs
        w_gate_up = jnp.concatenate([wg, wu], axis=1)

        def run_tile(offset, count, carry):
            d_rows, d_w_gate_up, d_wd = carry
            x, dy, h = _take(rows, offset, count), _take(d_out, offset, count), _take(gate_up, offset, count)
            g, u = h[:, :expert_dim], h[:, expert_dim:]
            silu_gate, silu_grad = _silu_and_grad(g)
            d_hidden = dy @ wd.T
            d_g = (d_hidden.astype(jnp.float32) * u.astype(jnp.float32) * silu_grad).astype(g.dtype)
            d_gate_up = jnp.concatenate([d_g, d_hidden * silu_gate], axis=1)
            d_rows = _put(d_rows, d_gate_up @ w_gate_up.T, offset)
            return d_rows, d_w_gate_up + x.T @ d_gate_up, d_wd + (silu_gate * u).T @ dy

        init = (d_rows, jnp.zeros_like(w_gate_up), jnp.zeros_like(wd))
        d_rows, d_w_gate_up, d_wd = _over_tiles(start, size, tile, wide, run_tile, init)
        return d_rows, (d_w_gate_up[:, :expert_dim], d_w_gate_up[:, expert_dim:], d_wd)

    d_rows, (d_gate_w, d_up_w, d_down_w) = jax.lax.scan(
        expert, jnp.zeros_like(rows), (w_gate, w_up, w_down, group_start, group_rows)
    )
    return d_rows, d_gate_w, d_up_w, d_down_w, None, None


grouped_swiglu.defvjp(_grouped_fwd, _grouped_bwd)
