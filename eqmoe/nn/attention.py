"""Grouped-query self-attention with rotary positions, QK-norm, per-token masks and a KV cache."""

import logging
from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqmoe.config import AttentionConfig
from eqmoe.nn._init import Init
from eqmoe.nn._params import Layer, Role, param
from eqmoe.nn.flash import blockwise_attention
from eqmoe.nn.lora import AttentionAdapters, adapted
from eqmoe.nn.norm import RMSNorm
from eqmoe.nn.rope import apply_rope
from eqmoe.registry import Registry

_log = logging.getLogger(__name__)


class AttentionMask(eqx.Module):
    """Which keys each query sees, described per token instead of as a ``[batch, queries, keys]`` tensor.

    Query ``q`` sees key ``t`` when ``key_index[t] <= query_index[q]`` (causal), both lie in the same
    packed document (``query_segment == key_segment``) and the key is a real token (``key_valid``, HF's
    ``attention_mask``). ``plain_causal`` is a static promise that nothing but causality masks anything
    (one document, no padding, queries and keys the same tokens), which lets fused kernels run.
    """

    query_index: Int[Array, " queries"]
    key_index: Int[Array, " keys"]
    query_segment: Int[Array, "batch queries"]
    key_segment: Int[Array, "batch keys"]
    key_valid: Bool[Array, "batch keys"]
    plain_causal: bool = eqx.field(static=True, default=False)

    def dense(self) -> Bool[Array, "batch queries keys"]:
        """The mask as a tensor (the reference backend; quadratic in length)."""
        causal = self.key_index[None, :] <= self.query_index[:, None]
        same = self.query_segment[:, :, None] == self.key_segment[:, None, :]
        return causal[None] & same & self.key_valid[:, None, :]


def attention_mask(segment_ids: Int[Array, "batch seq"], token_mask: Bool[Array, "batch seq"]) -> AttentionMask:
    """The training mask: causal, within each packed document (equal ``segment_ids``), real keys only."""
    index = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
    return AttentionMask(index, index, segment_ids, segment_ids, token_mask)


def causal_mask(batch: int, seq: int) -> AttentionMask:
    """Plain causal attention over ``seq`` tokens of one document each, no padding."""
    index = jnp.arange(seq, dtype=jnp.int32)
    zeros = jnp.zeros((batch, seq), jnp.int32)
    return AttentionMask(index, index, zeros, zeros, jnp.ones((batch, seq), bool), plain_causal=True)


def cache_mask(index: Int[Array, ""], seq: int, valid: Bool[Array, "batch max_len"]) -> AttentionMask:
    """``seq`` new tokens written at cache slots ``index ..``: each sees the valid slots up to its own."""
    batch, max_len = valid.shape
    zeros = jnp.zeros((batch, max_len), jnp.int32)
    slots = index + jnp.arange(seq, dtype=jnp.int32)
    return AttentionMask(slots, jnp.arange(max_len, dtype=jnp.int32), zeros[:, :seq], zeros, valid)


class LayerCache(NamedTuple):
    """Keys and values of one attention block for cached decoding, in the compute dtype, head-major.

    Slot ``t`` of ``max_len`` holds the token written at step ``t`` (the cache's write index, not the
    RoPE position). In a :class:`eqmoe.nn.stack.RepeatedUnit` every leaf carries a leading ``repeats``
    axis, stacked like the parameters; a single block sees one repeat.
    """

    keys: Float[Array, "*repeats batch kv_heads max_len head_dim"]
    values: Float[Array, "*repeats batch kv_heads max_len head_dim"]


Queries = Float[Array, "batch kv_heads group queries head_dim"]
KeysOrValues = Float[Array, "batch kv_heads keys head_dim"]


def _scale(x: Float[Array, "*shape"], factor: float) -> Float[Array, "*shape"]:
    """``x * factor`` rounded once; a Python float times a bfloat16 array would first round the factor."""
    return (x.astype(jnp.float32) * factor).astype(x.dtype)


def dense_attention(
    q: Queries, k: KeysOrValues, v: KeysOrValues, mask: AttentionMask, *, scale: float, block_size: int
) -> Queries:
    """The reference: every score materialised, HF eager numerics (scores in the compute dtype, scaled
    once, softmax in float32, probabilities cast back). A query that sees no key gets output 0."""
    batch, kv_heads, group, queries, head_dim = q.shape
    rows = q.reshape(batch, kv_heads, group * queries, head_dim)  # one free axis: faster einsums on XLA:CPU
    scores = jnp.einsum("bnqd,bnkd->bnqk", rows, k)
    if scale != 1.0:
        scores = _scale(scores, scale)
    visible = mask.dense()[:, None, None]
    visible = jnp.broadcast_to(visible, (batch, 1, group, *visible.shape[3:])).reshape(batch, 1, rows.shape[2], -1)
    scores = jnp.where(visible, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1)
    probs = jnp.where(jnp.any(visible, axis=-1, keepdims=True), probs, 0.0).astype(q.dtype)
    return jnp.einsum("bnqk,bnkd->bnqd", probs, v).reshape(q.shape)


def cudnn_attention(
    q: Queries, k: KeysOrValues, v: KeysOrValues, mask: AttentionMask, *, scale: float, block_size: int
) -> Queries:
    """cuDNN's fused flash attention through ``jax.nn.dot_product_attention`` (GPU, half precision,
    plain causal masks only)."""
    if not mask.plain_causal:
        raise ValueError("attention backend 'cudnn' needs a plain causal mask (no packing, padding or cache)")
    batch, kv_heads, group, queries, head_dim = q.shape
    q_bthd = q.reshape(batch, kv_heads * group, queries, head_dim).transpose(0, 2, 1, 3)
    out = jax.nn.dot_product_attention(
        q_bthd, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), scale=scale, is_causal=True, implementation="cudnn"
    )
    return out.transpose(0, 2, 1, 3).reshape(q.shape)


# ``backend(q, k, v, mask, *, scale, block_size) -> out``, every one equal to ``dense_attention``.
# ``AttentionConfig.backend`` accepts the registered names and ``"auto"`` (:func:`backend_name`).
Backend = Callable[..., Queries]
BACKENDS: Registry[Backend] = Registry("attention backend")
BACKENDS.register("blockwise", blockwise_attention)
BACKENDS.register("dense", dense_attention)
BACKENDS.register("cudnn", cudnn_attention)


def backend_name(config: AttentionConfig, mask: AttentionMask, dtype, platform: str | None = None) -> str:
    """The backend ``config.attention_backend`` resolves to: ``auto`` is ``cudnn`` on GPU for half
    precision and a plain causal mask, ``blockwise`` otherwise."""
    name = config.backend
    if name != "auto":
        return name
    platform = jax.default_backend() if platform is None else platform
    half = jnp.dtype(dtype) in (jnp.dtype("bfloat16"), jnp.dtype("float16"))
    return "cudnn" if platform == "gpu" and half and mask.plain_causal else "blockwise"


_logged: set[tuple[str, str]] = set()


def _resolve(config: AttentionConfig, mask: AttentionMask, dtype) -> Backend:
    name = backend_name(config, mask, dtype)
    if (config.backend, name) not in _logged:  # once per choice, at trace time
        _logged.add((config.backend, name))
        _log.info("attention backend %r runs as %r", config.backend, name)
    return BACKENDS.get(name)


def _with_bias(y: Float[Array, "tokens out"], bias: Float[Array, "*out"] | None) -> Float[Array, "tokens out"]:
    return y if bias is None else y + bias.reshape(-1).astype(y.dtype)


def _whole(norm: RMSNorm, x: Float[Array, "batch seq heads head_dim"]) -> Float[Array, "batch seq heads head_dim"]:
    """``norm`` over every head's dimensions at once (OLMoE's QK-norm of the whole projection)."""
    return norm(x.reshape(*x.shape[:2], -1)).reshape(x.shape)


class Attention(Layer):
    """Multi-head attention whose ``num_kv_heads`` key/value heads are shared by groups of query heads.

    HF Qwen3MoeAttention: q/k/v projections without bias, RMSNorm over ``head_dim`` on q and k (one
    scale shared by all heads) before RoPE, scores scaled by ``head_dim^-0.5``, softmax in float32.
    AXLearn Envy (``qk_norm="after_rope"``): ``q = RMSNorm(RoPE(q)) * head_dim^-0.5``,
    ``k = RMSNorm(RoPE(k))``, scores unscaled. The score computation is ``AttentionConfig.backend``.
    With ``AttentionConfig.bias`` the projections add ``bq``, ``bk``, ``bv`` (and ``bo``); the norms and
    ``clip_qkv`` follow the biases, as in transformers' OLMoE.
    """

    wq: Float[Array, "embed heads head_dim"] = param(Role.ATTENTION)
    wk: Float[Array, "embed kv_heads head_dim"] = param(Role.ATTENTION)
    wv: Float[Array, "embed kv_heads head_dim"] = param(Role.ATTENTION)
    wo: Float[Array, "heads head_dim embed"] = param(Role.ATTENTION)
    bq: Float[Array, "heads head_dim"] | None = param(Role.BIAS)
    bk: Float[Array, "kv_heads head_dim"] | None = param(Role.BIAS)
    bv: Float[Array, "kv_heads head_dim"] | None = param(Role.BIAS)
    bo: Float[Array, " embed"] | None = param(Role.BIAS)
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    lora: AttentionAdapters | None
    config: AttentionConfig = eqx.field(static=True)

    def __init__(
        self,
        embed_dim: int,
        config: AttentionConfig,
        *,
        eps: float,
        stats_dtype: str,
        init: Init,
        key: PRNGKeyArray,
    ):
        kq, kk, kv, ko = jax.random.split(key, 4)
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.wq = init.weight(kq, (embed_dim, heads, head_dim), fan_in=embed_dim)
        self.wk = init.weight(kk, (embed_dim, kv_heads, head_dim), fan_in=embed_dim)
        self.wv = init.weight(kv, (embed_dim, kv_heads, head_dim), fan_in=embed_dim)
        self.wo = init.weight(ko, (heads, head_dim, embed_dim), fan_in=heads * head_dim)
        with_bias = config.bias != "none"
        self.bq = jnp.zeros((heads, head_dim), init.dtype) if with_bias else None
        self.bk = jnp.zeros((kv_heads, head_dim), init.dtype) if with_bias else None
        self.bv = jnp.zeros((kv_heads, head_dim), init.dtype) if with_bias else None
        self.bo = jnp.zeros((embed_dim,), init.dtype) if config.bias == "qkvo" else None
        with_norm = config.qk_norm != "none"
        norm = dict(eps=eps, dtype=init.dtype, stats_dtype=stats_dtype)
        whole = config.qk_norm_scope == "projection"
        self.q_norm = RMSNorm(heads * head_dim if whole else head_dim, **norm) if with_norm else None
        self.k_norm = RMSNorm(kv_heads * head_dim if whole else head_dim, **norm) if with_norm else None
        self.lora = None
        self.config = config

    def _project(
        self,
        x: Float[Array, "batch seq embed"],
        cos: Float[Array, "batch seq rotary_dim"],
        sin: Float[Array, "batch seq rotary_dim"],
        key: PRNGKeyArray | None = None,
    ) -> tuple[Queries, KeysOrValues, KeysOrValues]:
        """Queries, keys and values, normed and rotated, head-major (queries pre-scaled with ``after_rope``)."""
        # Flat [tokens, embed] matmuls: XLA:CPU's backward pass is much slower on split token axes.
        batch, seq, embed = x.shape
        flat = x.reshape(batch * seq, embed)
        q, k, v = (
            _with_bias(adapted(flat, w, self.lora, name, key), bias).reshape(batch, seq, *w.shape[1:])
            for w, bias, name in ((self.wq, self.bq, "q"), (self.wk, self.bk, "k"), (self.wv, self.bv, "v"))
        )
        config = self.config
        layout, placement = config.rope_layout, config.qk_norm
        if placement == "before_rope" and config.qk_norm_scope == "projection":
            q, k = _whole(self.q_norm, q), _whole(self.k_norm, k)
        elif placement == "before_rope":
            q, k = self.q_norm(q), self.k_norm(k)
        if config.clip_qkv is not None:
            q, k, v = (jnp.clip(t, -config.clip_qkv, config.clip_qkv) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin, layout), apply_rope(k, cos, sin, layout)
        if placement == "after_rope":
            q, k = _scale(self.q_norm(q), q.shape[-1] ** -0.5), self.k_norm(k)
        kv_heads, head_dim = k.shape[2], k.shape[3]
        q = q.reshape(batch, seq, kv_heads, -1, head_dim).transpose(0, 2, 3, 1, 4)
        return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def _attend(
        self, q: Queries, k: KeysOrValues, v: KeysOrValues, mask: AttentionMask, key: PRNGKeyArray | None = None
    ) -> Float[Array, "batch seq embed"]:
        batch, _, _, seq, _ = q.shape
        scale = 1.0 if self.config.qk_norm == "after_rope" else q.shape[-1] ** -0.5
        backend = _resolve(self.config, mask, q.dtype)
        out = backend(q, k, v, mask, scale=scale, block_size=self.config.block_size)
        out = out.transpose(0, 3, 1, 2, 4).reshape(batch * seq, -1)
        return _with_bias(adapted(out, self.wo, self.lora, "o", key), self.bo).reshape(batch, seq, -1)

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        cos: Float[Array, "batch seq rotary_dim"],
        sin: Float[Array, "batch seq rotary_dim"],
        mask: AttentionMask,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "batch seq embed"]:
        q, k, v = self._project(x, cos, sin, key)
        return self._attend(q, k, v, mask, key)

    def decode(
        self,
        x: Float[Array, "batch seq embed"],
        cos: Float[Array, "batch seq rotary_dim"],
        sin: Float[Array, "batch seq rotary_dim"],
        mask: AttentionMask,
        cache: LayerCache,
        index: Int[Array, ""],
    ) -> tuple[Float[Array, "batch seq embed"], LayerCache]:
        """Attention of ``seq`` new tokens over the cache: their keys and values are written into slots
        ``index .. index + seq - 1`` and the queries attend to the ``max_len`` slots under ``mask``
        (:func:`cache_mask`). Returns the output and the updated cache."""
        q, k, v = self._project(x, cos, sin)
        start = (0, 0, index, 0)
        keys = jax.lax.dynamic_update_slice(cache.keys, k.astype(cache.keys.dtype), start)
        values = jax.lax.dynamic_update_slice(cache.values, v.astype(cache.values.dtype), start)
        out = self._attend(q, keys.astype(q.dtype), values.astype(v.dtype), mask)
        return out, LayerCache(keys, values)
