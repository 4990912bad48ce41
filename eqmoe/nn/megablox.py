"""The TPU's grouped matrix product (megablox's Pallas ``gmm``): rows sorted by expert times each expert's matrix.

``gmm(x, w, group_sizes)`` multiplies the first ``group_sizes[0]`` rows of ``x`` by ``w[0]``, the next by ``w[1]``
and so on, in tiles of ``(rows, in, out) = tiles``; its backward pass is the same kernel and its transposed form
(``tgmm``). Rows past the last group are not computed by the kernel; :func:`gmm` returns zeros there. The row count
must be a whole number of row tiles, so callers pad the sorted rows once (:func:`padded_rows`) and every product of
the layer reuses that padding.

Tiles decide the speed (measured on one v5e chip, 262,144 rows 1024 -> 256: (128, 128, 128) 110 ms, (1024, 256,
256) 17 ms), so ``auto`` measures a few on the run's shapes (:mod:`eqmoe.autotune`). A tile larger than its
dimension, or one that does not divide it, shrinks (:func:`_fit`). Off the TPU
the kernel runs in Pallas interpret mode, for checking.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eqmoe.nn._pallas import operand_precision

# the kernels' module (its package exports the function ``gmm`` under the same name)
_kernels = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

PLATFORMS = ("tpu",)
Tiles = tuple[int, int, int]
LANE = 128


def _fit(dim: int, tile: int) -> int:
    """``tile`` for a dimension of ``dim``: a multiple of 128 (Mosaic's lanes; the whole dimension only below 128), the
    largest up to ``tile`` and ``dim`` that divides ``dim``, else the largest up to both (the kernel masks the ragged
    last tile: 288 = 256 + 32)."""
    if dim <= LANE:
        return dim
    top = min(tile, dim) // LANE * LANE
    for size in range(top, LANE - 1, -LANE):
        if dim % size == 0:
            return size
    return top


def row_tile(rows: int, tiles: Tiles) -> int:
    """The row tile for ``rows`` sorted rows: ``tiles[0]``, or fewer rows rounded up to 128 when there are fewer."""
    return min(tiles[0], -(-rows // LANE) * LANE)


def padded_rows(rows: int, tiles: Tiles) -> int:
    """``rows`` rounded up to whole row tiles."""
    tile = row_tile(rows, tiles)
    return -(-rows // tile) * tile


def kernel_tiles(rows: int, dims: tuple[int, ...], tiles: Tiles) -> tuple[int, ...]:
    """The tiles the kernel runs at for ``rows`` sorted rows and products between widths ``dims`` (either side of
    each): the row tile, then each width's fitted tile as a product's input and as its output. Tilings alike here
    are one program (on small experts every tile shrinks to the same widths)."""
    return (row_tile(rows, tiles), *(_fit(d, tiles[1]) for d in dims), *(_fit(d, tiles[2]) for d in dims))


def gmm(
    x: Float[Array, "rows fan_in"],
    w: Float[Array, "experts fan_in fan_out"],
    group_sizes: Int[Array, " experts"],
    tiles: Tiles,
) -> Float[Array, "rows fan_out"]:
    """Row group ``e`` of ``x`` times ``w[e]``, in ``x``'s dtype (accumulated in float32); ``x``'s rows a multiple of
    its row tile (:func:`padded_rows`)."""
    rows = row_tile(x.shape[0], tiles)
    if x.shape[0] % rows:
        raise ValueError(f"gmm: {x.shape[0]} rows are not whole tiles of {rows} (pad them with padded_rows)")
    y = _grouped(x, w.astype(x.dtype), group_sizes, (rows, *tiles[1:]))
    # the kernel leaves rows past the last group unwritten (any bits, NaN among them): zeros, so that no product
    # downstream (an adapter's ragged dot, a gradient) meets them; one select, fused with what reads y
    inside = jnp.arange(x.shape[0])[:, None] < jnp.sum(group_sizes)
    return jnp.where(inside, y, 0)


def _tiling(tiles: Tiles, fan_in: int, fan_out: int) -> Tiles:
    """``tiles`` fitted to one product's own dimensions: the backward pass multiplies by the transposed matrix, whose
    dimensions are the forward's swapped, so each product fits its tiles afresh (a tile fitted to 64 columns is no
    valid block of 96 on the chip, which wants whole dimensions or multiples of 128)."""
    return tiles[0], _fit(fan_in, tiles[1]), _fit(fan_out, tiles[2])


def _interpret() -> bool:
    return jax.default_backend() not in PLATFORMS


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(x, w, group_sizes, tiles):
    tiling = _tiling(tiles, x.shape[1], w.shape[2])
    with operand_precision(x.dtype):
        return _kernels.gmm(x, w, group_sizes, x.dtype, tiling, interpret=_interpret())


def _grouped_forward(x, w, group_sizes, tiles):
    return _grouped(x, w, group_sizes, tiles), (x, w, group_sizes)


def _grouped_backward(tiles, residuals, grad):
    x, w, group_sizes = residuals
    # d x = grad @ w[e]^T, a product from fan_out to fan_in; d w[e] = x^T @ grad over each group's rows
    into = _tiling(tiles, w.shape[2], w.shape[1])
    over = _tiling(tiles, x.shape[1], w.shape[2])
    with operand_precision(x.dtype):
        grad_x = _kernels.gmm(grad, w, group_sizes, x.dtype, into, transpose_rhs=True, interpret=_interpret())
        grad_w = _kernels.tgmm(
            x.swapaxes(0, 1), grad, group_sizes, w.dtype, over, None, w.shape[0], interpret=_interpret()
        )
    return grad_x, grad_w, None


_grouped.defvjp(_grouped_forward, _grouped_backward)
