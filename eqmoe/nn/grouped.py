"""Grouped expert computation over rows sorted by expert, with a hand-written backward pass.

The rows arrive as one ``[rows, embed]`` buffer in which expert ``e`` owns the ``group_rows[e]`` rows from
``group_start[e]`` on (both multiples of ``tile``; the layout pads each group). An outer ``lax.scan`` over
the experts takes one expert at a time (:meth:`eqmoe.nn.experts.RoutedExperts.fused`: its input side as one
``[embed, 2 * expert_dim]`` product), and inner loops run that expert's rows in tiles: as many ``wide``-row
tiles as fit, then halving tiles down to ``tile`` rows for the rest, so rows go through a few large, efficient
matmuls while a group is padded by less than ``tile`` rows. Each expert's weights are read once per layer (on
XLA:CPU a weight slice taken inside a loop is a copy), and rows no expert owns (the tail of the static buffer)
are never visited and stay zero.

Why a custom VJP: differentiating the weight slice inside the loop would make JAX add a full
``[experts, embed, expert_dim]`` zero-padded gradient per tile. The backward pass mirrors the forward: per
expert, each tile's gradient of the expert's two halves is taken with ``jax.vjp`` from the saved
pre-activations (nothing recomputed but the cheap activation), summed in a local accumulator, and mapped back
through the fusion to that expert's row of the stacked gradients. Whatever the expert's matrices carry (biases,
LoRA adapters) is differentiated with them; this module never names it.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eqmoe.nn.experts import RoutedExperts


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


def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def grouped_experts(
    rows: Float[Array, "rows embed"],
    experts: RoutedExperts,
    group_start: Int[Array, " experts"],
    group_rows: Int[Array, " experts"],
    tile: int,
    wide: int,
) -> Float[Array, "rows embed"]:
    """Each row through its group's expert."""
    return _forward(rows, experts, group_start, group_rows, tile, wide, keep=False)[0]


def _forward(rows, experts, group_start, group_rows, tile, wide, *, keep: bool):
    """The output rows and (with ``keep``, for the backward pass) every row's pre-activations. A loop cannot
    drop a buffer it carries, so inference does not carry one."""
    pre_width = 2 * experts.expert_dim

    def expert(buffers, inputs):
        one, start, size = inputs
        fused = one.fused()

        def run_tile(offset, count, buffers):
            pre = fused.pre_activations(_take(rows, offset, count))
            out = _put(buffers[0], fused.output(pre), offset)
            return (out, _put(buffers[1], pre, offset)) if keep else (out,)

        return _over_tiles(start, size, tile, wide, run_tile, buffers), None

    init = (jnp.zeros_like(rows),)
    if keep:
        init += (jnp.zeros((rows.shape[0], pre_width), rows.dtype),)
    buffers, _ = jax.lax.scan(expert, init, (experts, group_start, group_rows))
    return buffers


def _grouped_fwd(rows, experts, group_start, group_rows, tile, wide):
    out, pre = _forward(rows, experts, group_start, group_rows, tile, wide, keep=True)
    return out, (rows, pre, experts, group_start, group_rows)


def _grouped_bwd(tile, wide, residuals, d_out):
    rows, pre, experts, group_start, group_rows = residuals

    def expert(d_rows, inputs):
        one, start, size = inputs
        fused, unfuse = jax.vjp(lambda e: e.fused(), one)

        def run_tile(offset, count, carry):
            d_rows, d_fused = carry
            x, dy, h = _take(rows, offset, count), _take(d_out, offset, count), _take(pre, offset, count)
            _, output_vjp = jax.vjp(lambda f, h: f.output(h), fused, h)
            d_out_side, d_pre = output_vjp(dy)
            _, input_vjp = jax.vjp(lambda f, x: f.pre_activations(x), fused, x)
            d_in_side, d_x = input_vjp(d_pre)
            d_fused = _add(d_fused, _add(d_out_side, d_in_side))
            return _put(d_rows, d_x, offset), d_fused

        zeros = jax.tree.map(jnp.zeros_like, fused)
        d_rows, d_fused = _over_tiles(start, size, tile, wide, run_tile, (d_rows, zeros))
        (d_one,) = unfuse(d_fused)
        return d_rows, d_one

    d_rows, d_experts = jax.lax.scan(expert, jnp.zeros_like(rows), (experts, group_start, group_rows))
    return d_rows, d_experts, None, None


grouped_experts.defvjp(_grouped_fwd, _grouped_bwd)
