"""Multi-head latent attention (DeepSeek-V2/V3): the ``mla`` attention kind.

Per token, keys and values of every head come from one normed latent ``c = RMSNorm(x W_kv_a)`` of width
``kv_rank`` expanded by ``W_kv_b``, beside one rotated key slice shared by all heads; queries come through their
own low-rank pair ``q_b(RMSNorm(q_a(x)))`` (or one ``q`` matrix). With ``nope = head_dim - rope_dim``::

    q_h = [q_nope_h ; RoPE(q_rope_h)]              (head_dim wide)
    [c ; k_rope] = x W_kv_a,  c <- RMSNorm(c)
    [k_nope_h ; v_h] = c W_kv_b                      (nope and value_dim wide)
    k_h = [k_nope_h ; RoPE(k_rope)]                  (k_rope shared by every head)
    o = concat_h softmax(scale q_h k_h^T + mask) v_h  W_o

``scale = head_dim^-0.5``, times YaRN's ``mscale(factor, mscale_all_dim)^2`` under YaRN scaling, as transformers'
``yarn_apply_mscale`` folds it in. The decoding cache keeps what the keys and values are rebuilt from: the normed
latent and the rotated shared key, ``kv_rank + rope_dim`` values per token whatever the number of heads.
"""

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqmoe.config import AttentionConfig, LayerKind, ModelConfig
from eqmoe.nn._init import Init
from eqmoe.nn.attention_backends import attend
from eqmoe.nn.context import Context
from eqmoe.nn.kinds import AttentionKind, Cost, PlanShape, keys_seen
from eqmoe.nn.linear import Linear
from eqmoe.nn.norm import RMSNorm
from eqmoe.nn.rope import apply_rope, rope_tables, yarn_softmax_scale
from eqmoe.params import Role
from eqmoe.registries import ATTENTION_KINDS
from eqmoe.tensor_names import TensorName, linear_names


class LatentCache(NamedTuple):
    """One MLA layer's decoding cache: the normed latent and the rotated shared key of every slot, in the compute
    dtype (a leading ``repeats`` axis in a scanned segment, like the parameters)."""

    latent: Float[Array, "*repeats batch max_len kv_rank"]
    rope_key: Float[Array, "*repeats batch max_len rope_dim"]


@ATTENTION_KINDS.register("mla")
class LatentAttention(AttentionKind):
    """Multi-head latent attention as transformers' ``DeepseekV3Attention`` / ``DeepseekV2Attention`` compute it.

    ``AttentionConfig.latent`` gives the widths; ``rope_layout="interleaved"`` rotates pairs ``(2i, 2i+1)``
    (DeepSeek-V2, V3's ``rope_interleave``; transformers' V3 writes the rotated pairs de-interleaved, which only
    permutes dimensions that queries and keys share, so the scores are the same). ``AttentionConfig.bias="qkvo"``
    is transformers' ``attention_bias``: biases on ``q_a``, ``kv_a`` and ``o`` (never on ``q``, ``q_b``, ``kv_b``).
    """

    q: Linear | None
    q_a: Linear | None
    q_norm: RMSNorm | None
    q_b: Linear | None
    kv_a: Linear
    kv_norm: RMSNorm
    kv_b: Linear
    o: Linear
    config: AttentionConfig = eqx.field(static=True)

    def __init__(self, config: ModelConfig, layer: LayerKind, *, init: Init, key: PRNGKeyArray):
        attention, embed = config.attention, config.embed_dim
        latent, heads, width = attention.latent, attention.num_heads, attention.head_dim
        nope = width - latent.rope_dim
        k_q, k_qb, k_kva, k_kvb, k_o = jax.random.split(key, 5)
        biased = attention.bias == "qkvo"
        linear = dict(role=Role.ATTENTION, init=init)
        norm = dict(config=config.norm, dtype=init.dtype, eps=latent.norm_eps)
        per_head = ("heads", "head_dim")
        if latent.q_rank is None:
            self.q = Linear((embed,), (heads, width), in_axes=("embed",), out_axes=per_head, key=k_q, **linear)
            self.q_a = self.q_norm = self.q_b = None
        else:
            self.q = None
            rank = (latent.q_rank,)
            self.q_a = Linear((embed,), rank, in_axes=("embed",), out_axes=("latent",), key=k_q, bias=biased, **linear)
            self.q_norm = RMSNorm.of(dim=latent.q_rank, **norm)
            self.q_b = Linear(rank, (heads, width), in_axes=("latent",), out_axes=per_head, key=k_qb, **linear)
        compressed = (latent.kv_rank + latent.rope_dim,)
        self.kv_a = Linear(
            (embed,), compressed, in_axes=("embed",), out_axes=("latent",), key=k_kva, bias=biased, **linear
        )
        self.kv_norm = RMSNorm.of(dim=latent.kv_rank, **norm)
        expanded = (heads, nope + latent.value_dim)
        self.kv_b = Linear((latent.kv_rank,), expanded, in_axes=("latent",), out_axes=per_head, key=k_kvb, **linear)
        self.o = Linear(
            (heads, latent.value_dim), (embed,), in_axes=per_head, out_axes=("embed",), key=k_o, bias=biased, **linear
        )
        self.config = attention

    def _queries(self, flat: Float[Array, "tokens embed"], keys: list) -> Float[Array, "tokens heads_width"]:
        if self.q is not None:
            return self.q(flat, keys[0])
        return self.q_b(self.q_norm(self.q_a(flat, keys[0])), keys[1])

    def _rope(self, positions: Int[Array, "batch seq"], dtype) -> tuple[Array, Array]:
        config = self.config
        rope = config.latent.rope_dim
        return rope_tables(positions, rope, config.rope_theta, dtype, config.rope_layout, config.rope_scaling)

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        context: Context,
        cache: LatentCache | None = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], LatentCache | None]:
        """With a cache, the new tokens' latents and rotated keys are written into slots ``context.cache_index ..``
        and the queries attend to every slot under ``context.mask``."""
        config, latent = self.config, self.config.latent
        batch, seq, embed = x.shape
        heads, width = config.num_heads, config.head_dim
        nope = width - latent.rope_dim
        keys = [None] * 5 if key is None else [jax.random.fold_in(key, i) for i in range(5)]
        flat = x.reshape(batch * seq, embed)
        cos, sin = self._rope(context.positions, x.dtype)
        q = self._queries(flat, keys).reshape(batch, seq, heads, width)
        q = jnp.concatenate([q[..., :nope], apply_rope(q[..., nope:], cos, sin, config.rope_layout)], axis=-1)
        compressed = self.kv_a(flat, keys[2]).reshape(batch, seq, -1)
        c = self.kv_norm(compressed[..., : latent.kv_rank])
        rope_key = apply_rope(compressed[..., None, latent.kv_rank :], cos, sin, config.rope_layout)[:, :, 0]
        scale = width**-0.5 * yarn_softmax_scale(config.rope_scaling)
        if cache is not None:
            start = (0, context.cache_index, 0)
            cache = LatentCache(
                jax.lax.dynamic_update_slice(cache.latent, c.astype(cache.latent.dtype), start),
                jax.lax.dynamic_update_slice(cache.rope_key, rope_key.astype(cache.rope_key.dtype), start),
            )
            c, rope_key = cache.latent.astype(x.dtype), cache.rope_key.astype(x.dtype)
            if latent.decode == "absorbed":
                out = self._attend_latents(q, c, rope_key, context, scale).reshape(batch * seq, -1)
                return self.o(out, keys[4]).reshape(batch, seq, embed), cache
        slots = c.shape[1]
        expanded = self.kv_b(c.reshape(batch * slots, -1), keys[3]).reshape(batch, slots, heads, -1)
        shared = jnp.broadcast_to(rope_key[:, :, None], (batch, slots, heads, latent.rope_dim))
        k = jnp.concatenate([expanded[..., :nope], shared], axis=-1).transpose(0, 2, 1, 3)
        v = expanded[..., nope:].transpose(0, 2, 1, 3)
        q = q.transpose(0, 2, 1, 3)[:, :, None]  # [batch, heads, 1, seq, width]: one query head per key head
        out = attend(config, q, k, v, context.mask, scale=scale, window=None)
        out = out[:, :, 0].transpose(0, 2, 1, 3).reshape(batch * seq, heads * latent.value_dim)
        return self.o(out, keys[4]).reshape(batch, seq, embed), cache

    def _attend_latents(
        self,
        q: Float[Array, "batch seq heads width"],
        c: Float[Array, "batch slots kv_rank"],
        rope_key: Float[Array, "batch slots rope_dim"],
        context: Context,
        scale: float,
    ) -> Float[Array, "batch seq heads value_dim"]:
        """Attention read straight from the cached latents: ``q_nope k_nope^T = (q_nope W_k^T) c^T`` with ``W_k`` the
        key half of ``kv_b`` (per head), so every query head attends to one shared key ``[c ; k_rope]`` and value
        ``c``, and ``W_v``, the value half, maps each head's weighted latent to its value width afterwards. The
        same scores and outputs as expanding the cache, at ``kv_rank + rope_dim`` values per cached token."""
        nope = self.config.head_dim - self.config.latent.rope_dim
        weight = self.kv_b.weight_array()  # [kv_rank, heads, nope + value_dim]
        if self.kv_b.adapter is not None:  # an adapter on kv_b is folded in, as the expanded path applies it
            weight = weight + self.kv_b.adapter.delta().astype(weight.dtype)
        weight = weight.astype(q.dtype)
        absorbed = jnp.einsum("bthn,rhn->bhtr", q[..., :nope], weight[..., :nope])
        queries = jnp.concatenate([absorbed, q[..., nope:].transpose(0, 2, 1, 3)], axis=-1)[:, None]
        shared_key = jnp.concatenate([c, rope_key], axis=-1)[:, None]
        out = attend(self.config, queries, shared_key, c[:, None], context.mask, scale=scale, window=None)
        return jnp.einsum("bhtr,rhv->bthv", out[:, 0], weight[..., nope:])

    @classmethod
    def init_cache(cls, config: ModelConfig, layer: LayerKind, batch: int, max_len: int, dtype) -> LatentCache:
        latent = config.attention.latent
        return LatentCache(
            jnp.zeros((batch, max_len, latent.kv_rank), dtype), jnp.zeros((batch, max_len, latent.rope_dim), dtype)
        )

    @classmethod
    def check(cls, config: ModelConfig, layer: LayerKind) -> None:
        attention = config.attention
        problems = {
            "attention.latent": (attention.latent is not None, "a LatentAttentionConfig (the mla kind's widths)"),
            "attention.num_kv_heads": (attention.num_kv_heads == attention.num_heads, f"{attention.num_heads}"),
            "attention.qk_norm": (attention.qk_norm == "none", "'none'"),
            "attention.rotary_dim": (attention.rotary_dim is None, "None (latent.rope_dim says what rotates)"),
            "attention.clip_qkv": (attention.clip_qkv is None, "None"),
            "attention.bias": (attention.bias in ("none", "qkvo"), "'none' | 'qkvo' (q_a, kv_a and o)"),
            "window": (layer.window is None, "None"),
        }
        for name, (ok, allowed) in problems.items():
            if not ok:
                value = layer.window if name == "window" else getattr(attention, name.split(".")[1])
                raise ValueError(f"{name}={value!r} is invalid for latent attention; allowed: {allowed}")

    @classmethod
    def plan(cls, config: ModelConfig, layer: LayerKind, shape: PlanShape) -> Cost:
        """Kept per token: the input, the query latent and queries, the compressed latent, the expanded keys and
        values, the output and the float32 log-sum-exp; the ``dense`` backend keeps its float32 scores and
        probabilities too. FLOPs: scores over ``head_dim`` and values over ``value_dim`` for the visible keys,
        forward and backward (blockwise recomputes the scores). Cache: the latent and the shared rotated key; a cache
        of expanded keys and values would hold ``heads (head_dim + value_dim)`` values per token."""
        attention, c = config.attention, shape.bytes
        latent, width, d = attention.latent, attention.head_dim, config.embed_dim
        heads = shape.split(attention.num_heads)
        q_rank = latent.q_rank or 0
        compressed = latent.kv_rank + latent.rope_dim
        expanded = heads * (width - latent.rope_dim + latent.value_dim)
        kept = c * (2 * d + q_rank + 2 * heads * width + compressed + expanded + 2 * heads * latent.value_dim)
        kept += 4 * heads
        pair = 2 * heads * (width + latent.value_dim)  # one query against one key: scores and values
        cache, expanded_cache = c * compressed, c * attention.num_heads * (width + latent.value_dim)
        if attention.backend == "dense":
            flops = 3 * pair * shape.seq
            return Cost(kept + 10 * heads * shape.seq, flops=flops, cache=cache, expanded_cache=expanded_cache)
        tile = min(attention.block_size, shape.seq)
        blocks = -(-shape.seq // tile)
        per_step = shape.tokens * 4 * heads * width + 4 * shape.rows * heads * tile * tile
        flops = 3.5 * pair * shape.seq * (blocks + 1) / (2 * blocks)
        return Cost(kept, per_step, flops=flops, cache=cache, expanded_cache=expanded_cache)

    @classmethod
    def forward_flops(cls, config: ModelConfig, layer: LayerKind, seq: int, causal: bool = True) -> float:
        """Scores over the query/key width and values over ``value_dim``, per head and visible key (the training
        step's expanded form; absorbed decoding trades them for the latent's)."""
        attention = config.attention
        per_key = 2 * attention.num_heads * (attention.head_dim + attention.latent.value_dim)
        return per_key * keys_seen(seq, layer.window, causal)

    @classmethod
    def checkpoint_names(
        cls, config: ModelConfig, layer: LayerKind, prefix: str, path: tuple, index: tuple[int, ...]
    ) -> list[TensorName]:
        """transformers' names: ``q_proj`` or ``q_a_proj`` + ``q_a_layernorm`` + ``q_b_proj``, then
        ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj`` and ``o_proj``."""
        biased = config.attention.bias == "qkvo"
        if config.attention.latent.q_rank is None:
            names = linear_names(prefix + "q_proj", (*path, "q"), index)
        else:
            names = linear_names(prefix + "q_a_proj", (*path, "q_a"), index, bias=biased)
            names.append(TensorName(prefix + "q_a_layernorm.weight", (*path, "q_norm", "weight"), index))
            names += linear_names(prefix + "q_b_proj", (*path, "q_b"), index)
        names += linear_names(prefix + "kv_a_proj_with_mqa", (*path, "kv_a"), index, bias=biased)
        names.append(TensorName(prefix + "kv_a_layernorm.weight", (*path, "kv_norm", "weight"), index))
        names += linear_names(prefix + "kv_b_proj", (*path, "kv_b"), index)
        names += linear_names(prefix + "o_proj", (*path, "o"), index, in_dims=2, bias=biased)
        return names
