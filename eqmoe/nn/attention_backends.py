"""The kernels of softmax attention: given queries, keys, values and a mask description, the attention output.

Every backend computes ``softmax(scale * q k^T + mask) v`` with the same numbers and differs in how; each is
registered in :data:`eqmoe.registries.ATTENTION_BACKENDS` under the name ``AttentionConfig.backend`` uses
(``"auto"`` is a resolution rule, :func:`backend_name`). Signature::

    backend(q, k, v, mask, *, scale, block_size, window, sinks) -> out

with queries ``[batch, kv_heads, group, queries, qk_dim]`` (query head ``h = n * group + i`` reads key/value head
``n``, as HF's ``repeat_kv``), keys ``[batch, kv_heads, keys, qk_dim]``, values ``[batch, kv_heads, keys, v_dim]``
(a value width of its own) and the output ``[batch, kv_heads, group, queries, v_dim]``. ``mask`` is an
:class:`eqmoe.nn.context.AttentionMask`, ``window`` a sliding layer's window (``None``: full), ``sinks`` a float32
``[kv_heads, group]`` logit per query head that joins every softmax and is dropped after it (gpt-oss's attention
sinks; ``None``: none). A backend that cannot compute something refuses it in one line.
"""

import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float

from eqmoe.config import AttentionConfig
from eqmoe.nn import splash
from eqmoe.nn.context import AttentionMask
from eqmoe.nn.flash import blockwise_attention
from eqmoe.registries import ATTENTION_BACKENDS

_log = logging.getLogger(__name__)

Queries = Float[Array, "batch kv_heads group queries qk_dim"]
Keys = Float[Array, "batch kv_heads keys qk_dim"]
Values = Float[Array, "batch kv_heads keys v_dim"]
Output = Float[Array, "batch kv_heads group queries v_dim"]


def scale_once(x: Float[Array, "*shape"], factor: float) -> Float[Array, "*shape"]:
    """``x * factor`` rounded once; a Python float times a bfloat16 array would first round the factor."""
    return (x.astype(jnp.float32) * factor).astype(x.dtype)


Sinks = Float[Array, "kv_heads group"]


def dense_attention(
    q: Queries,
    k: Keys,
    v: Values,
    mask: AttentionMask,
    *,
    scale: float,
    block_size: int,
    window: int | None = None,
    sinks: Sinks | None = None,
) -> Output:
    """The reference: every score materialised, HF eager numerics (scores in the compute dtype, scaled
    once, softmax in float32, probabilities cast back). A sink is one more column of the softmax, dropped after
    it (transformers' ``gpt_oss`` eager attention). A query that sees no key gets output 0."""
    batch, kv_heads, group, queries, _ = q.shape
    rows = q.reshape(batch, kv_heads, group * queries, q.shape[-1])  # one free axis: faster einsums on XLA:CPU
    scores = jnp.einsum("bnqd,bnkd->bnqk", rows, k)
    if scale != 1.0:
        scores = scale_once(scores, scale)
    visible = mask.dense(window)[:, None, None]
    visible = jnp.broadcast_to(visible, (batch, 1, group, *visible.shape[3:])).reshape(batch, 1, rows.shape[2], -1)
    scores = jnp.where(visible, scores, jnp.finfo(scores.dtype).min)
    scores = scores.astype(jnp.float32)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        column = jnp.broadcast_to(
            jnp.repeat(sinks.astype(jnp.float32), queries, axis=1)[None, :, :, None],
            (batch, kv_heads, rows.shape[2], 1),
        )
        probs = jax.nn.softmax(jnp.concatenate([scores, column], axis=-1), axis=-1)[..., :-1]
    probs = jnp.where(jnp.any(visible, axis=-1, keepdims=True), probs, 0.0).astype(q.dtype)
    out = jnp.einsum("bnqk,bnkd->bnqd", probs, v)
    return out.reshape(batch, kv_heads, group, queries, v.shape[-1])


def cudnn_attention(
    q: Queries,
    k: Keys,
    v: Values,
    mask: AttentionMask,
    *,
    scale: float,
    block_size: int,
    window: int | None = None,
    sinks: Sinks | None = None,
) -> Output:
    """cuDNN's fused flash attention through ``jax.nn.dot_product_attention`` (GPU, half precision,
    plain causal masks only, no sinks)."""
    if not mask.plain_causal or window is not None or sinks is not None or q.shape[-1] != v.shape[-1]:
        raise ValueError(
            "attention backend 'cudnn' needs a plain causal mask (no packing, padding, cache or window), no attention "
            "sinks and equal query and value widths"
        )
    batch, kv_heads, group, queries, head_dim = q.shape
    q_bthd = q.reshape(batch, kv_heads * group, queries, head_dim).transpose(0, 2, 1, 3)
    out = jax.nn.dot_product_attention(
        q_bthd, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), scale=scale, is_causal=True, implementation="cudnn"
    )
    return out.transpose(0, 2, 1, 3).reshape(batch, kv_heads, group, queries, -1)


Backend = Callable[..., Output]
ATTENTION_BACKENDS.register("blockwise", blockwise_attention)
ATTENTION_BACKENDS.register("dense", dense_attention)
ATTENTION_BACKENDS.register("cudnn", cudnn_attention)
ATTENTION_BACKENDS.register("splash", splash.splash_attention)
BACKENDS = ATTENTION_BACKENDS  # the name this registry had before it moved to eqmoe.registries


def backend_name(
    config: AttentionConfig,
    mask: AttentionMask,
    dtype,
    platform: str | None = None,
    window: int | None = None,
    same_widths: bool = True,
    sinks: bool = False,
    lengths: tuple[int, int] | None = None,
) -> str:
    """The backend ``config.backend`` resolves to: ``auto`` is ``splash`` on a TPU where the kernel can compute the
    call (``lengths``, queries and keys, given and self-attention over a multiple of 128 tokens); ``cudnn`` on GPU for
    half precision, a plain causal mask, no window, no sinks and equal query and value widths; ``blockwise``
    otherwise."""
    name = config.backend
    if name != "auto":
        return name
    platform = jax.default_backend() if platform is None else platform
    if platform in splash.PLATFORMS and lengths is not None and splash.refusal(*lengths) is None:
        return "splash"
    half = jnp.dtype(dtype) in (jnp.dtype("bfloat16"), jnp.dtype("float16"))
    fused = platform == "gpu" and half and mask.plain_causal and window is None and same_widths and not sinks
    return "cudnn" if fused else "blockwise"


_logged: set[tuple[str, str]] = set()


def attend(
    config: AttentionConfig,
    q: Queries,
    k: Keys,
    v: Values,
    mask: AttentionMask,
    *,
    scale: float,
    window: int | None,
    sinks: Sinks | None = None,
) -> Output:
    """``config.backend``'s attention (resolving ``auto``), logged once per choice at trace time."""
    same_widths = q.shape[-1] == v.shape[-1]
    lengths = (q.shape[3], k.shape[2])
    name = backend_name(
        config, mask, q.dtype, window=window, same_widths=same_widths, sinks=sinks is not None, lengths=lengths
    )
    if (config.backend, name) not in _logged:
        _logged.add((config.backend, name))
        _log.info("attention backend %r runs as %r", config.backend, name)
    backend = ATTENTION_BACKENDS.get(name)
    if sinks is None:  # a backend registered before sinks existed keeps working where none are asked for
        out = backend(q, k, v, mask, scale=scale, block_size=config.block_size, window=window)
    else:
        out = backend(q, k, v, mask, scale=scale, block_size=config.block_size, window=window, sinks=sinks)
    return checkpoint_name(out, "attention")  # kept by remat "dots" (eqmoe.nn.stack.REMAT_POLICIES)
