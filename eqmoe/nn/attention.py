"""Grouped-query self-attention with rotary positions, per-head QK-norm, document masks and a KV cache."""

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqmoe.config import AttentionConfig
from eqmoe.nn._init import Init
from eqmoe.nn.norm import RMSNorm
from eqmoe.nn.rope import apply_rope


def attention_mask(
    segment_ids: Int[Array, "batch seq"], token_mask: Bool[Array, "batch seq"]
) -> Bool[Array, "batch seq seq"]:
    """``mask[b, q, k]``: query ``q`` may see key ``k``.

    Causal, within the same packed document (equal ``segment_ids``), and only real keys
    (``token_mask``, like HF's ``attention_mask``).
    """
    seq = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    same_document = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal[None] & same_document & token_mask[:, None, :]


class LayerCache(NamedTuple):
    """Keys and values of one attention block for cached decoding, in the compute dtype.

    Slot ``t`` of ``max_len`` holds the token written at step ``t`` (the cache's write index, not the
    RoPE position). In a :class:`eqmoe.nn.stack.RepeatedUnit` every leaf carries a leading ``repeats``
    axis, stacked like the parameters; a single block sees one repeat.
    """

    keys: Float[Array, "*repeats batch max_len kv_heads head_dim"]
    values: Float[Array, "*repeats batch max_len kv_heads head_dim"]


def _scale(x: Float[Array, "*shape"], factor: float) -> Float[Array, "*shape"]:
    """``x * factor`` rounded once; a Python float times a bfloat16 array would first round the factor."""
    return (x.astype(jnp.float32) * factor).astype(x.dtype)


class Attention(eqx.Module):
    """Multi-head attention whose ``num_kv_heads`` key/value heads are shared by groups of query heads.

    HF Qwen3MoeAttention: q/k/v projections without bias, RMSNorm over ``head_dim`` on q and k (one
    scale shared by all heads) before RoPE, scores scaled by ``head_dim^-0.5``, softmax in float32.
    AXLearn Envy (``qk_norm="after_rope"``): ``q = RMSNorm(RoPE(q)) * head_dim^-0.5``,
    ``k = RMSNorm(RoPE(k))``, scores unscaled.
    """

    wq: Float[Array, "embed heads head_dim"]
    wk: Float[Array, "embed kv_heads head_dim"]
    wv: Float[Array, "embed kv_heads head_dim"]
    wo: Float[Array, "heads head_dim embed"]
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
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
        with_norm = config.qk_norm != "none"
        norm = dict(eps=eps, dtype=init.dtype, stats_dtype=stats_dtype)
        self.q_norm = RMSNorm(head_dim, **norm) if with_norm else None
        self.k_norm = RMSNorm(head_dim, **norm) if with_norm else None
        self.config = config

    def _project(
        self,
        x: Float[Array, "batch seq embed"],
        cos: Float[Array, "batch seq head_dim"],
        sin: Float[Array, "batch seq head_dim"],
    ) -> tuple[
        Float[Array, "batch seq heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
    ]:
        """Queries, keys and values, normed and rotated (queries pre-scaled with ``after_rope``)."""
        # Flat [tokens, embed] matmuls: XLA:CPU's backward pass is much slower on split token axes.
        batch, seq, embed = x.shape
        flat = x.reshape(batch * seq, embed)
        q, k, v = ((flat @ w.reshape(embed, -1)).reshape(batch, seq, *w.shape[1:]) for w in (self.wq, self.wk, self.wv))
        layout, placement = self.config.rope_layout, self.config.qk_norm
        if placement == "before_rope":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin, layout), apply_rope(k, cos, sin, layout)
        if placement == "after_rope":
            q, k = _scale(self.q_norm(q), q.shape[-1] ** -0.5), self.k_norm(k)
        return q, k, v

    def _attend(
        self,
        q: Float[Array, "batch seq heads head_dim"],
        k: Float[Array, "batch keys kv_heads head_dim"],
        v: Float[Array, "batch keys kv_heads head_dim"],
        mask: Bool[Array, "batch seq keys"],
    ) -> Float[Array, "batch seq embed"]:
        batch, seq, heads, head_dim = q.shape
        kv_heads = k.shape[2]
        # Query head h reads key/value head h // group, as HF's repeat_kv lays them out.
        q = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)
        scores = jnp.einsum("bqngk,btnk->bngqt", q, k)
        if self.config.qk_norm != "after_rope":
            scores = _scale(scores, head_dim**-0.5)
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
        out = jnp.einsum("bngqt,btnk->bqngk", probs, v).reshape(batch * seq, heads * head_dim)
        return (out @ self.wo.reshape(heads * head_dim, -1)).reshape(batch, seq, -1)

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        cos: Float[Array, "batch seq head_dim"],
        sin: Float[Array, "batch seq head_dim"],
        mask: Bool[Array, "batch seq seq"],
    ) -> Float[Array, "batch seq embed"]:
        q, k, v = self._project(x, cos, sin)
        return self._attend(q, k, v, mask)

    def decode(
        self,
        x: Float[Array, "batch seq embed"],
        cos: Float[Array, "batch seq head_dim"],
        sin: Float[Array, "batch seq head_dim"],
        mask: Bool[Array, "batch seq max_len"],
        cache: LayerCache,
        index: Int[Array, ""],
    ) -> tuple[Float[Array, "batch seq embed"], LayerCache]:
        """Attention of ``seq`` new tokens over the cache: their keys and values are written into slots
        ``index .. index + seq - 1`` and the queries attend to all ``max_len`` slots under ``mask``
        (``mask[b, q, t]``: query ``q`` may see slot ``t``). Returns the output and the updated cache."""
        q, k, v = self._project(x, cos, sin)
        start = (0, index, 0, 0)
        keys = jax.lax.dynamic_update_slice(cache.keys, k.astype(cache.keys.dtype), start)
        values = jax.lax.dynamic_update_slice(cache.values, v.astype(cache.values.dtype), start)
        out = self._attend(q, keys.astype(q.dtype), values.astype(v.dtype), mask)
        return out, LayerCache(keys, values)
