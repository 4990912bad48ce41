"""Splash attention: the TPU's own Pallas flash kernel (``jax.experimental.pallas.ops.tpu.splash_attention``) as an
attention backend.

The kernel takes one example at a time, queries ``[heads, seq, qk_dim]`` over keys ``[kv_heads, seq, qk_dim]`` and
values ``[kv_heads, seq, v_dim]``: query head ``h`` reads key/value head ``h // (heads / kv_heads)``, eqmoe's
grouped-query order, so repeated keys and values are never materialised; values may be narrower or wider than
queries (latent attention). Its mask is static (causal, or causal and a sliding window, per head) and the tokens'
own facts travel as segment ids: a key that is padding gets a segment no query has. gpt-oss's sinks are the
kernel's own (the running maximum and normaliser start from the sink, as :mod:`eqmoe.nn.flash` does).

What the kernel cannot compute is refused in one line (:func:`refusal`): a sequence that is not a multiple of
128 tokens, queries that are not the keys (a decoding cache), a mask that is not causal self-attention over
positions ``0 .. seq - 1``. Off the TPU the kernel runs in Pallas interpret mode: that is how the CPU suite checks
it against ``dense``; it is slow there, so ``auto`` offers it on the TPU alone.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
from jaxtyping import Array, Float

from eqmoe.nn._pallas import at_operand_precision
from eqmoe.nn.context import AttentionMask

PLATFORMS = ("tpu",)
LANE = 128  # the kernel's blocks are whole multiples of the TPU's 128 lanes


def block_for(seq: int, block_size: int) -> int:
    """The kernel's block: the largest multiple of 128 that divides ``seq`` and is at most ``block_size`` (at least
    128)."""
    best = LANE
    for block in range(LANE, min(seq, max(block_size, LANE)) + 1, LANE):
        if seq % block == 0:
            best = block
    return best


def refusal(queries: int, keys: int) -> str | None:
    """Why splash cannot compute this attention (``None``: it can)."""
    if queries != keys:
        return f"attention backend 'splash' needs queries that are the keys (self-attention); got {queries} over {keys}"
    if queries % LANE:
        return f"attention backend 'splash' needs a sequence length that is a multiple of {LANE}; got {queries}"
    return None


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, seq: int, window: int | None, block: int, interpret: bool):
    """The kernel for one shape and mask, built once (building it reads the mask block by block in NumPy)."""
    shape = (seq, seq)
    if window is None:
        head_mask = mask_lib.CausalMask(shape)
    else:  # key_index > query_index - window: up to window - 1 keys back, none ahead
        head_mask = mask_lib.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    sizes = kernel_lib.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    with jax.ensure_compile_time_eval():  # its mask arrays are constants: cached, they must not be a trace's tracers
        return kernel_lib.make_splash_mha(
            mask_lib.MultiHeadMask([head_mask] * heads),
            block_sizes=sizes,
            head_shards=1,
            q_seq_shards=1,
            interpret=interpret,
        )


def splash_attention(
    q: Float[Array, "batch kv_heads group queries qk_dim"],
    k: Float[Array, "batch kv_heads keys qk_dim"],
    v: Float[Array, "batch kv_heads keys v_dim"],
    mask: AttentionMask,
    *,
    scale: float,
    block_size: int,
    window: int | None = None,
    sinks: Float[Array, "kv_heads group"] | None = None,
) -> Float[Array, "batch kv_heads group queries v_dim"]:
    """``softmax(scale * q k^T + mask) v`` by the splash kernel, blocks of :func:`block_for` ``(seq, block_size)``.

    The mask's causal order is the kernel's static one (keys and queries at positions ``0 .. seq - 1``, the
    training mask); packed documents and padding are segment ids. A query that sees no key gets output 0, as in
    every backend (the kernel would average the hidden values)."""
    batch, kv_heads, group, queries, qk_dim = q.shape
    why = refusal(queries, k.shape[2])
    if why is not None:
        raise ValueError(why)
    interpret = jax.default_backend() not in PLATFORMS
    kernel = _kernel(kv_heads * group, queries, window, block_for(queries, block_size), interpret)
    rows = (q.astype(jnp.float32) * scale).astype(q.dtype).reshape(batch, kv_heads * group, queries, qk_dim)
    hidden = jnp.iinfo(jnp.int32).min  # a padding key's segment: no query's
    key_segment = jnp.where(mask.key_valid, mask.key_segment, hidden).astype(jnp.int32)
    segments = kernel_lib.SegmentIds(q=mask.query_segment.astype(jnp.int32), kv=key_segment)
    flat_sinks = None if sinks is None else sinks.reshape(-1).astype(jnp.float32)
    if flat_sinks is None:
        per_row = at_operand_precision(jax.vmap(lambda q, k, v, segments: kernel(q, k, v, segments)), q.dtype)
        out = per_row(rows, k, v, segments)
    else:
        in_axes = (0, 0, 0, 0, None)
        per_row = at_operand_precision(jax.vmap(kernel, in_axes=in_axes), q.dtype)
        out = per_row(rows, k, v, segments, flat_sinks)
    sees_any = jnp.any(mask.dense(window), axis=-1)  # [batch, queries]; a fused reduction, nothing materialised
    out = jnp.where(sees_any[:, None, :, None], out, 0).astype(q.dtype)
    return out.reshape(batch, kv_heads, group, queries, v.shape[-1])
