"""Blockwise (flash-style) attention: memory linear in sequence length, hidden blocks skipped.

Queries and keys are cut into blocks. For each query block a loop over the key blocks it can see keeps a
running maximum ``m``, normaliser ``l`` and output accumulator (the online softmax of FlashAttention), so
no ``[queries, keys]`` matrix is ever held beyond one ``[block, block]`` tile. Which tiles are computed
comes from the mask description (:class:`eqmoe.nn.context.AttentionMask`): a tile whose keys are all
in the causal future of its queries, all padding, all in other packed documents or all behind a sliding
window is never visited, so causal attention costs about half of full attention, packed short documents less
still, and a sliding layer's cost grows with window x length, not length squared.

The backward pass (a custom VJP, FlashAttention-2's) saves only the output and the log-sum-exp of each
query row and recomputes every tile's probabilities: one loop over key blocks accumulates that block's
key and value gradients while adding each tile's query gradient into place.

Layout: queries ``[batch, kv_heads, group, queries, qk_dim]`` (query head ``h = n * group + i`` reads
key/value head ``n``, as HF's ``repeat_kv``), keys ``[batch, kv_heads, keys, qk_dim]``, values
``[batch, kv_heads, keys, v_dim]`` (their own width).
Scores, the softmax and all accumulators are float32; matmul inputs stay in the compute dtype.
A query that sees no key at all (left padding) gets output 0.

Attention sinks (gpt-oss) are one learned logit per query head that joins every query's softmax and takes a share
of the probability without a value: the running maximum and normaliser start from the sink instead of from
nothing (``m = s``, ``l = 1``), so the log-sum-exp the backward pass reads already counts it, and the sink's
gradient is ``-sum_rows exp(s - lse) * D`` with ``D = dO . O``. Without sinks the sink is ``-inf`` and every
number is what it was.
"""

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

_FAR = 2**30  # an index or segment id no real token has


class _Blocks(NamedTuple):
    """The padded mask description, cut into blocks, and which (query block, key block) tiles to visit."""

    query_index: Int[Array, "q_blocks q_block"]
    key_index: Int[Array, "k_blocks k_block"]
    query_segment: Int[Array, "batch q_blocks q_block"]
    key_segment: Int[Array, "batch k_blocks k_block"]
    key_valid: Bool[Array, "batch k_blocks k_block"]
    live: Bool[Array, "q_blocks k_blocks"]


def _pad(x: Array, length: int, axis: int, value) -> Array:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _blocks(mask, q_len: int, k_len: int, block_q: int, block_k: int, window: int | None) -> _Blocks:
    """Pad the mask's per-token arrays to whole blocks and find the tiles that hold any visible pair.

    A tile is live when its earliest key is not after its latest query (causality), its latest key is inside
    the window of its earliest query (a sliding layer) and, in some row of the batch, the segment ids of its
    valid keys and of its queries overlap as ranges: exact for packed rows (non-decreasing ids), conservative
    otherwise.
    """
    batch = mask.query_segment.shape[0]
    nq, nk = q_len // block_q, k_len // block_k
    query_index = _pad(mask.query_index, q_len, 0, -1).reshape(nq, block_q)
    key_index = _pad(mask.key_index, k_len, 0, _FAR).reshape(nk, block_k)
    query_real = _pad(jnp.ones_like(mask.query_segment, bool), q_len, 1, False).reshape(batch, nq, block_q)
    query_segment = _pad(mask.query_segment, q_len, 1, -_FAR).reshape(batch, nq, block_q)
    key_valid = _pad(mask.key_valid, k_len, 1, False).reshape(batch, nk, block_k)
    key_segment = _pad(mask.key_segment, k_len, 1, _FAR).reshape(batch, nk, block_k)

    q_lo = jnp.min(jnp.where(query_real, query_segment, _FAR), axis=2)
    q_hi = jnp.max(jnp.where(query_real, query_segment, -_FAR), axis=2)
    k_lo = jnp.min(jnp.where(key_valid, key_segment, _FAR), axis=2)
    k_hi = jnp.max(jnp.where(key_valid, key_segment, -_FAR), axis=2)
    overlap = (k_lo[:, None, :] <= q_hi[:, :, None]) & (k_hi[:, None, :] >= q_lo[:, :, None])
    causal = jnp.min(key_index, axis=1)[None, :] <= jnp.max(query_index, axis=1)[:, None]
    if window is not None:  # a tile's latest key within the window of its earliest real query
        first_query = jnp.min(jnp.where(query_index >= 0, query_index, _FAR), axis=1)
        causal = causal & (jnp.max(key_index, axis=1)[None, :] > first_query[:, None] - window)
    live = causal & jnp.any(overlap, axis=0)
    return _Blocks(query_index, key_index, query_segment, key_segment, key_valid, live)


def _bounds(live: Bool[Array, "outer inner"]) -> tuple[Int[Array, " outer"], Int[Array, " outer"]]:
    """For each row of ``live``, the range ``[lo, hi)`` from its first to its last true entry (empty if none)."""
    inner = live.shape[1]
    lo = jnp.argmax(live, axis=1).astype(jnp.int32)
    hi = (inner - jnp.argmax(live[:, ::-1], axis=1)).astype(jnp.int32)
    return lo, jnp.where(jnp.any(live, axis=1), hi, lo)


def _visible(blocks: _Blocks, i, j, group: int, window: int | None) -> Bool[Array, "batch 1 rows k_block"]:
    """The exact mask of tile ``(i, j)`` for its ``group * q_block`` query rows, broadcast over kv heads."""
    causal = blocks.key_index[j][None, :] <= blocks.query_index[i][:, None]
    if window is not None:
        causal = causal & (blocks.key_index[j][None, :] > blocks.query_index[i][:, None] - window)
    same = blocks.query_segment[:, i, :, None] == blocks.key_segment[:, j, None, :]
    visible = causal[None] & same & blocks.key_valid[:, j, None, :]
    batch, block_q, block_k = visible.shape
    return jnp.broadcast_to(visible[:, None, None], (batch, 1, group, block_q, block_k)).reshape(batch, 1, -1, block_k)


def _slice(x: Array, start, size: int, axis: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, start * size, size, axis)


def _query_rows(x: Array, i, block_q: int) -> Array:
    """Query block ``i`` of ``x`` (``[batch, kv_heads, group, queries, ...]``) as ``[batch, kv_heads, group *
    q_block, ...]`` rows: every einsum then has one free axis per side, which XLA:CPU runs much faster
    (in the backward pass especially) than two."""
    tile = _slice(x, i, block_q, 3)
    return tile.reshape(*tile.shape[:2], -1, *tile.shape[4:])


def _einsum(spec: str, a: Array, b: Array) -> Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _sink_rows(sinks: Float[Array, "kv_heads group"], batch: int, block_q: int) -> Float[Array, "batch kv_heads rows"]:
    """Each query row's sink logit in the ``[batch, kv_heads, group * q_block]`` row layout of a tile."""
    return jnp.broadcast_to(
        jnp.repeat(sinks, block_q, axis=1)[None], (batch, *sinks.shape[:1], sinks.shape[1] * block_q)
    )


def _forward(q, k, v, sinks, blocks: _Blocks, scale: float, block_q: int, block_k: int, window: int | None):
    batch, kv_heads, group, _, _ = q.shape
    v_dim = v.shape[-1]
    nq, nk = blocks.live.shape
    lo, hi = _bounds(blocks.live)

    def query_block(_, i):
        q_tile = _query_rows(q, i, block_q)
        shape = q_tile.shape[:3]

        def key_block(j, carry):
            def compute(carry):
                m, denom, acc = carry
                scores = _einsum("bnqd,bnkd->bnqk", q_tile, _slice(k, j, block_k, 2)) * scale
                scores = jnp.where(_visible(blocks, i, j, group, window), scores, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
                shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                p = jnp.exp(scores - shift[..., None])
                correction = jnp.exp(m - shift)
                pv = _einsum("bnqk,bnkd->bnqd", p.astype(v.dtype), _slice(v, j, block_k, 2))
                return m_new, denom * correction + jnp.sum(p, axis=-1), acc * correction[..., None] + pv

            return jax.lax.cond(blocks.live[i, j], compute, lambda carry: carry, carry)

        sink = _sink_rows(sinks, batch, block_q)  # -inf without sinks: l starts at 0 as plain online softmax
        init = (sink, jnp.where(sink == -jnp.inf, 0.0, 1.0), jnp.zeros((*shape, v_dim), jnp.float32))
        m, denom, acc = jax.lax.fori_loop(lo[i], hi[i], key_block, init)
        seen = denom > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, denom, 1.0)[..., None], 0.0).astype(q.dtype)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), 0.0)
        return None, (out.reshape(batch, kv_heads, group, block_q, v_dim), lse.reshape(batch, kv_heads, group, -1))

    _, (out, lse) = jax.lax.scan(query_block, None, jnp.arange(nq))
    # [q_blocks, batch, kv_heads, group, q_block, ...] -> [batch, kv_heads, group, queries, ...]
    out = jnp.moveaxis(out, 0, 3).reshape(*q.shape[:-1], v_dim)
    lse = jnp.moveaxis(lse, 0, 3).reshape(q.shape[:-1])
    return out, lse


def _backward(q, k, v, sinks, out, lse, d_out, blocks: _Blocks, scale: float, block_q: int, block_k: int, window):
    group = q.shape[2]
    nq, nk = blocks.live.shape
    lo, hi = _bounds(blocks.live.T)
    # D_i = sum_d dO_i * O_i: the row term of the softmax gradient.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    # the sink's probability in each row, exp(s - lse), times -D_i, summed over batch and queries
    d_sinks = -jnp.sum(jnp.exp(sinks[None, :, :, None] - lse) * delta, axis=(0, 3))

    def key_block(d_q, j):
        k_tile, v_tile = _slice(k, j, block_k, 2), _slice(v, j, block_k, 2)

        def query_block(i, carry):
            def compute(carry):
                d_q, d_k, d_v = carry
                q_tile, d_out_tile = _query_rows(q, i, block_q), _query_rows(d_out, i, block_q)
                scores = _einsum("bnqd,bnkd->bnqk", q_tile, k_tile) * scale
                p = jnp.exp(scores - _query_rows(lse, i, block_q)[..., None])
                p = jnp.where(_visible(blocks, i, j, group, window), p, 0.0)
                d_v = d_v + _einsum("bnqk,bnqd->bnkd", p.astype(d_out.dtype), d_out_tile)
                d_p = _einsum("bnqd,bnkd->bnqk", d_out_tile, v_tile)
                d_s = (p * (d_p - _query_rows(delta, i, block_q)[..., None]) * scale).astype(q.dtype)
                d_q_tile = _slice(d_q, i, block_q, 3) + _einsum("bnqk,bnkd->bnqd", d_s, k_tile).reshape(
                    *q.shape[:3], block_q, -1
                )
                d_q = jax.lax.dynamic_update_slice_in_dim(d_q, d_q_tile, i * block_q, 3)
                d_k = d_k + _einsum("bnqk,bnqd->bnkd", d_s, q_tile)
                return d_q, d_k, d_v

            return jax.lax.cond(blocks.live[i, j], compute, lambda carry: carry, carry)

        zeros_k, zeros_v = jnp.zeros(k_tile.shape, jnp.float32), jnp.zeros(v_tile.shape, jnp.float32)
        d_q, d_k, d_v = jax.lax.fori_loop(lo[j], hi[j], query_block, (d_q, zeros_k, zeros_v))
        return d_q, (d_k, d_v)

    d_q, (d_k, d_v) = jax.lax.scan(key_block, jnp.zeros(q.shape, jnp.float32), jnp.arange(nk))
    d_k = jnp.moveaxis(d_k, 0, 2).reshape(k.shape)
    d_v = jnp.moveaxis(d_v, 0, 2).reshape(v.shape)
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), d_sinks


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _attention(q, k, v, sinks, blocks: _Blocks, scale: float, block_q: int, block_k: int, window: int | None):
    return _forward(q, k, v, sinks, blocks, scale, block_q, block_k, window)[0]


def _attention_fwd(q, k, v, sinks, blocks, scale, block_q, block_k, window):
    out, lse = _forward(q, k, v, sinks, blocks, scale, block_q, block_k, window)
    return out, (q, k, v, sinks, out, lse, blocks)


def _attention_bwd(scale, block_q, block_k, window, residuals, d_out):
    q, k, v, sinks, out, lse, blocks = residuals
    d_q, d_k, d_v, d_sinks = _backward(q, k, v, sinks, out, lse, d_out, blocks, scale, block_q, block_k, window)
    return d_q, d_k, d_v, d_sinks, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def tile_size(block_size: int, window: int | None) -> int:
    """The tile edge for a layer: ``block_size``, or for a sliding layer its window rounded up to 8 (at least 64)
    when that is smaller. A query block then visits its own tile and one before it, so smaller tiles compute less
    outside the window (measured on 2 cores at 8,192 tokens, window 128: tiles of 128 take 0.65x the time of 256 in
    the forward+backward pass; 64 is slower again, their loop overhead outweighing the saving)."""
    if window is None:
        return block_size
    return min(block_size, max(64, -(-window // 8) * 8))


def _block_length(length: int, block: int) -> tuple[int, int]:
    """The block size for ``length`` tokens (one block when they fit) and the padded length."""
    size = min(block, length)
    return size, -(-length // size) * size


def blockwise_attention(
    q: Float[Array, "batch kv_heads group queries qk_dim"],
    k: Float[Array, "batch kv_heads keys qk_dim"],
    v: Float[Array, "batch kv_heads keys v_dim"],
    mask,
    *,
    scale: float,
    block_size: int,
    window: int | None = None,
    sinks: Float[Array, "kv_heads group"] | None = None,
) -> Float[Array, "batch kv_heads group queries v_dim"]:
    """``softmax(scale * q k^T + mask) v`` computed tile by tile (see the module docstring).

    ``mask`` is an :class:`eqmoe.nn.context.AttentionMask`; ``window`` a sliding layer's window (``None``:
    full; its tiles are :func:`tile_size`); ``sinks`` each query head's sink logit (``None``: none); sequence lengths
    need not be multiples of ``block_size`` (the last block is padded with tokens no one sees).
    """
    q_len, k_len = q.shape[3], k.shape[2]
    block_size = tile_size(block_size, window)
    block_q, q_padded = _block_length(q_len, block_size)
    block_k, k_padded = _block_length(k_len, block_size)
    blocks = _blocks(mask, q_padded, k_padded, block_q, block_k, window)
    padded = (_pad(q, q_padded, 3, 0), _pad(k, k_padded, 2, 0), _pad(v, k_padded, 2, 0))
    if sinks is None:
        sinks = jnp.full(q.shape[1:3], -jnp.inf, jnp.float32)
    out = _attention(*padded, sinks.astype(jnp.float32), blocks, scale, block_q, block_k, window)
    return out[:, :, :, :q_len]
