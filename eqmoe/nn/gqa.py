"""Grouped-query attention with rotary positions and QK-norm: the ``gqa`` attention kind."""

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqmoe.config import AttentionConfig, LayerKind, ModelConfig
from eqmoe.nn._init import Init
from eqmoe.nn.attention_backends import attend, scale_once
from eqmoe.nn.context import AttentionMask, Context
from eqmoe.nn.flash import tile_size
from eqmoe.nn.kinds import AttentionKind, Cost, PlanShape, keys_seen
from eqmoe.nn.linear import Linear
from eqmoe.nn.norm import RMSNorm
from eqmoe.nn.rope import apply_rope, rope_tables
from eqmoe.params import Role, param
from eqmoe.registries import ATTENTION_KINDS
from eqmoe.tensor_names import TensorName, linear_names


class LayerCache(NamedTuple):
    """Keys and values of one grouped-query attention layer for cached decoding, in the compute dtype.

    Slot ``t`` of ``max_len`` holds the token written at step ``t`` (the cache's write index, not the RoPE
    position). A sliding layer with ``AttentionConfig.sliding_cache="ring"`` keeps ``window`` slots instead, slot
    ``t % window`` holding step ``t``: no query of it looks further back. In a scanned segment every leaf carries a
    leading ``repeats`` axis, stacked like the parameters.
    """

    keys: Float[Array, "*repeats batch kv_heads max_len head_dim"]
    values: Float[Array, "*repeats batch kv_heads max_len head_dim"]


def _whole(norm: RMSNorm, x: Float[Array, "batch seq heads head_dim"]) -> Float[Array, "batch seq heads head_dim"]:
    """``norm`` over every head's dimensions at once (OLMoE's QK-norm of the whole projection)."""
    return norm(x.reshape(*x.shape[:2], -1)).reshape(x.shape)


@ATTENTION_KINDS.register("gqa")
class GroupedQueryAttention(AttentionKind):
    """Multi-head attention whose ``num_kv_heads`` key/value heads are shared by groups of query heads.

    HF Qwen3MoeAttention: q/k/v projections without bias, RMSNorm over ``head_dim`` on q and k (one
    scale shared by all heads) before RoPE, scores scaled by ``head_dim^-0.5``, softmax in float32.
    AXLearn Envy (``qk_norm="after_rope"``): ``q = RMSNorm(RoPE(q)) * head_dim^-0.5``,
    ``k = RMSNorm(RoPE(k))``, scores unscaled. With ``AttentionConfig.bias`` the projections carry biases; the
    norms and ``clip_qkv`` follow them, as in transformers' OLMoE. A sliding layer (``LayerKind.window``) sees
    only its window of keys. With ``AttentionConfig.sinks`` each query head has a learned logit that joins its
    softmax (gpt-oss, ``sinks``). With ``AttentionConfig.output_gate`` the output is gated per dimension by
    ``sigmoid`` of the query projection's second half (Qwen3-Next). The scores are computed by
    ``AttentionConfig.backend``.
    """

    q: Linear
    k: Linear
    v: Linear
    o: Linear
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    sinks: Float[Array, " heads"] | None = param(Role.SINK)
    config: AttentionConfig = eqx.field(static=True)
    window: int | None = eqx.field(static=True)

    def __init__(self, config: ModelConfig, layer: LayerKind, *, init: Init, key: PRNGKeyArray):
        attention, embed = config.attention, config.embed_dim
        heads, kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        kq, kk, kv, ko = jax.random.split(key, 4)
        biased = attention.bias != "none"
        project = dict(role=Role.ATTENTION, in_axes=("embed",), init=init, bias=biased)
        # with an output gate each head's query is followed by its gate, as the checkpoint's q_proj holds them
        query_width = 2 * head_dim if attention.output_gate else head_dim
        self.q = Linear((embed,), (heads, query_width), out_axes=("heads", "head_dim"), key=kq, **project)
        self.k = Linear((embed,), (kv_heads, head_dim), out_axes=("kv_heads", "head_dim"), key=kk, **project)
        self.v = Linear((embed,), (kv_heads, head_dim), out_axes=("kv_heads", "head_dim"), key=kv, **project)
        self.o = Linear(
            (heads, head_dim),
            (embed,),
            role=Role.ATTENTION,
            in_axes=("heads", "head_dim"),
            out_axes=("embed",),
            init=init,
            key=ko,
            bias=attention.bias == "qkvo",
        )
        whole = attention.qk_norm_scope == "projection"
        with_norm = attention.qk_norm != "none"
        norm = lambda width: RMSNorm.of(config.norm, width, init.dtype) if with_norm else None  # noqa: E731
        self.q_norm = norm(heads * head_dim if whole else head_dim)
        self.k_norm = norm(kv_heads * head_dim if whole else head_dim)
        sink_key = jax.random.fold_in(key, 1)  # drawn aside: a model without sinks initialises as before
        self.sinks = init.weight(sink_key, (heads,), fan_in=head_dim) if attention.sinks else None
        self.config = attention
        self.window = layer.window

    def _project(
        self, x: Float[Array, "batch seq embed"], positions: Int[Array, "batch seq"], keys: list | None
    ) -> tuple[Array, Array, Array, Array | None]:
        """Queries ``[batch, kv_heads, group, seq, head_dim]``, keys and values ``[batch, kv_heads, seq,
        head_dim]``: normed and rotated (queries pre-scaled with ``after_rope``); and the output gate's logits
        ``[batch * seq, heads * head_dim]`` (``None`` without one)."""
        # Flat [tokens, embed] matmuls: XLA:CPU's backward pass is much slower on split token axes.
        batch, seq, embed = x.shape
        flat = x.reshape(batch * seq, embed)
        key_q, key_k, key_v = (None, None, None) if keys is None else keys[:3]
        q = self.q(flat, key_q).reshape(batch, seq, *self.q.weight.shape[-2:])
        gate = None
        if self.config.output_gate:
            q, gate = jnp.split(q, 2, axis=-1)
            gate = gate.reshape(batch * seq, -1)
        k = self.k(flat, key_k).reshape(batch, seq, *self.k.weight.shape[-2:])
        v = self.v(flat, key_v).reshape(batch, seq, *self.v.weight.shape[-2:])
        config = self.config
        layout, placement = config.rope_layout, config.qk_norm
        if placement == "before_rope" and config.qk_norm_scope == "projection":
            q, k = _whole(self.q_norm, q), _whole(self.k_norm, k)
        elif placement == "before_rope":
            q, k = self.q_norm(q), self.k_norm(k)
        if config.clip_qkv is not None:
            q, k, v = (jnp.clip(t, -config.clip_qkv, config.clip_qkv) for t in (q, k, v))
        rotary = config.rotary_dim or config.head_dim
        cos, sin = rope_tables(positions, rotary, config.rope_theta, x.dtype, layout, config.rope_scaling)
        q, k = apply_rope(q, cos, sin, layout), apply_rope(k, cos, sin, layout)
        if placement == "after_rope":
            q, k = scale_once(self.q_norm(q), q.shape[-1] ** -0.5), self.k_norm(k)
        kv_heads, head_dim = k.shape[2], k.shape[3]
        q = q.reshape(batch, seq, kv_heads, -1, head_dim).transpose(0, 2, 3, 1, 4)
        return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), gate

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        context: Context,
        cache: LayerCache | None = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], LayerCache | None]:
        """With a cache, the new tokens' keys and values are written into slots ``context.cache_index ..`` and
        the queries attend to every slot under ``context.mask``."""
        keys = None if key is None else [jax.random.fold_in(key, i) for i in range(4)]
        q, k, v, gate = self._project(x, context.positions, keys)
        mask = context.mask
        if cache is not None and cache.keys.shape[-2] < mask.key_index.shape[0]:
            k, v, mask, cache = _ring(cache, k, v, mask)
        elif cache is not None:
            start = (0, 0, context.cache_index, 0)
            cache = LayerCache(
                jax.lax.dynamic_update_slice(cache.keys, k.astype(cache.keys.dtype), start),
                jax.lax.dynamic_update_slice(cache.values, v.astype(cache.values.dtype), start),
            )
            k, v = cache.keys.astype(q.dtype), cache.values.astype(q.dtype)
        scale = 1.0 if self.config.qk_norm == "after_rope" else q.shape[-1] ** -0.5
        sinks = None if self.sinks is None else self.sinks.astype(jnp.float32).reshape(k.shape[1], -1)
        out = attend(self.config, q, k, v, mask, scale=scale, window=self.window, sinks=sinks)
        batch, _, _, seq, _ = q.shape
        out = out.transpose(0, 3, 1, 2, 4).reshape(batch * seq, -1)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate)
        return self.o(out, None if keys is None else keys[3]).reshape(batch, seq, -1), cache

    @classmethod
    def init_cache(cls, config: ModelConfig, layer: LayerKind, batch: int, max_len: int, dtype) -> LayerCache:
        """``max_len`` slots, or a ring of ``window`` slots for a sliding layer (``sliding_cache="ring"``)."""
        attention = config.attention
        slots = max_len
        if layer.window is not None and attention.sliding_cache == "ring":
            slots = min(max_len, layer.window)
        shape = (batch, attention.num_kv_heads, slots, attention.head_dim)
        return LayerCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @classmethod
    def plan(cls, config: ModelConfig, layer: LayerKind, shape: PlanShape) -> Cost:
        """Kept per token: the input, the projections, the output and the float32 log-sum-exp the blockwise
        backward pass starts from; the ``dense`` backend keeps its float32 scores and probabilities too (``10 H T``
        with what XLA keeps beside them). Blockwise attention adds once per step its float32 query-gradient
        buffer and about one float32 ``[rows, H, B, B]`` tile. FLOPs: scores and values over the visible keys,
        forward and backward (blockwise computes only the causal tiles, ``(n + 1) / 2n`` of ``n`` blocks, and
        recomputes the scores in its backward pass)."""
        attention, c = config.attention, shape.bytes
        heads, kv, hd, d = (
            shape.split(attention.num_heads),
            shape.split(attention.num_kv_heads),
            attention.head_dim,
            config.embed_dim,
        )
        kept = c * (4 * d + 2 * (heads + 2 * kv) * hd + heads * hd) + 4 * heads
        if attention.output_gate:  # the gate's logits and the gated output
            kept += c * 2 * heads * hd
        keys = shape.seq if layer.window is None else min(shape.seq, layer.window)
        # a ring keeps the window's keys whatever the length: per token of a max_len cache, window / max_len of them
        cached = c * 2 * kv * hd
        if layer.window is not None and attention.sliding_cache == "ring":
            cached *= min(1.0, layer.window / shape.seq)
        blockwise = attention.backend != "dense"
        if not blockwise:
            return Cost(kept + 10 * heads * shape.seq, flops=12 * heads * hd * keys, cache=cached)
        tile = min(tile_size(attention.block_size, layer.window), shape.seq)
        blocks = -(-shape.seq // tile)
        visible = (blocks + 1) / (2 * blocks) if layer.window is None else min(1.0, (keys + tile) / shape.seq)
        per_step = shape.tokens * 4 * heads * hd + 4 * shape.rows * heads * tile * tile
        return Cost(kept, per_step, flops=14 * heads * hd * shape.seq * visible, cache=cached)

    @classmethod
    def forward_flops(cls, config: ModelConfig, layer: LayerKind, seq: int, causal: bool = True) -> float:
        """Scores ``q . k`` and the values' weighted sum, ``2 hd`` FLOPs each per head and visible key."""
        attention = config.attention
        return 4 * attention.num_heads * attention.head_dim * keys_seen(seq, layer.window, causal)

    @classmethod
    def checkpoint_names(
        cls, config: ModelConfig, layer: LayerKind, prefix: str, path: tuple, index: tuple[int, ...]
    ) -> list[TensorName]:
        """``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (with the biases ``AttentionConfig.bias`` gives) and the
        ``q_norm``/``k_norm`` scales, as transformers' decoders name them."""
        bias = config.attention.bias
        names = []
        for field, proj in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
            names += linear_names(prefix + proj, (*path, field), index, bias=bias != "none")
        names += linear_names(prefix + "o_proj", (*path, "o"), index, in_dims=2, bias=bias == "qkvo")
        if config.attention.qk_norm != "none":
            for norm in ("q_norm", "k_norm"):
                names.append(TensorName(prefix + f"{norm}.weight", (*path, norm, "weight"), index))
        if config.attention.sinks:
            names.append(TensorName(prefix + "sinks", (*path, "sinks"), index))
        return names


def _ring(cache: LayerCache, k: Array, v: Array, mask: AttentionMask) -> tuple[Array, Array, AttentionMask, LayerCache]:
    """Keys, values and mask of a sliding layer's step over its ring of ``W`` slots, and the ring after the step.

    The new tokens attend to the ring as it was (slot ``s`` holds the latest step ``t < index`` with ``t % W == s``)
    followed by themselves, so a prefill longer than the window still sees every key its window reaches; the mask
    (the step's own, read at those steps) applies the window. Then the last ``min(seq, W)`` new tokens are written to
    slots ``t % W``."""
    slots, seq = cache.keys.shape[-2], k.shape[-2]
    first = mask.query_index[0]  # the cache index: the step of the first new token
    held = first - 1 - jnp.mod(first - 1 - jnp.arange(slots, dtype=jnp.int32), slots)
    key_index = jnp.concatenate([held, mask.query_index])
    written = jnp.concatenate(
        [
            jnp.take(mask.key_valid, jnp.maximum(held, 0), axis=1) & (held >= 0)[None],
            jax.lax.dynamic_slice_in_dim(mask.key_valid, first, seq, axis=1),
        ],
        axis=1,
    )
    zeros = jnp.zeros_like(written, jnp.int32)
    ring_mask = AttentionMask(mask.query_index, key_index, mask.query_segment, zeros, written)
    keys = jnp.concatenate([cache.keys.astype(k.dtype), k], axis=2)
    values = jnp.concatenate([cache.values.astype(v.dtype), v], axis=2)
    kept = min(seq, slots)
    targets = jnp.mod(mask.query_index[seq - kept :], slots)
    ring = LayerCache(
        cache.keys.at[:, :, targets].set(k[:, :, seq - kept :].astype(cache.keys.dtype)),
        cache.values.at[:, :, targets].set(v[:, :, seq - kept :].astype(cache.values.dtype)),
    )
    return keys, values, ring_mask, ring
