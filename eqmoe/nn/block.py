"""The decoder block: attention then a dense or routed FFN, with the configured norm placement."""

from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqmoe.config import BlockKind, ModelConfig
from eqmoe.nn._init import Init
from eqmoe.nn._params import Layer
from eqmoe.nn.attention import Attention, AttentionMask, LayerCache
from eqmoe.nn.mlp import SwiGLU
from eqmoe.nn.moe import MoE
from eqmoe.nn.norm import RMSNorm
from eqmoe.nn.router import RouterStats
from eqmoe.registry import Registry


def model_init(config: ModelConfig) -> Init:
    """The weight initialisation ``config`` asks for."""
    return Init(config.init, config.init_std, jnp.dtype(config.param_dtype))


class Placement(NamedTuple):
    """Where the FFN's norms sit (``NormConfig.ffn_placement``, registered in :data:`PLACEMENTS`).

    **Arguments:**

    - `pre_norm`: whether the FFN reads ``pre_norm(x)`` (else ``x`` itself).
    - `post_norm`: whether the block has a second norm, ``post_norm``.
    - `residual`: ``residual(x, h, post_norm) -> x'``, the residual stream ``x`` combined with the FFN
      output ``h`` (``post_norm`` is ``None`` when the placement has none).
    """

    pre_norm: bool
    post_norm: bool
    residual: Callable[[Float[Array, "*b embed"], Float[Array, "*b embed"], RMSNorm | None], Float[Array, "*b embed"]]


PLACEMENTS: Registry[Placement] = Registry("FFN norm placement")
PLACEMENTS.register("pre", Placement(True, False, lambda x, h, post_norm: x + h))
PLACEMENTS.register("post", Placement(False, True, lambda x, h, post_norm: post_norm(x + h)))
PLACEMENTS.register("hybrid", Placement(True, True, lambda x, h, post_norm: x + post_norm(h)))


class Block(Layer):
    """``x += attention(attn_norm(x))`` then the FFN residual with ``NormConfig.ffn_placement``:

    - ``pre``: ``x + ffn(pre_norm(x))`` (HF Qwen3-MoE; ``pre_norm`` is ``post_attention_layernorm``)
    - ``post``: ``post_norm(x + ffn(x))``
    - ``hybrid``: ``x + post_norm(ffn(pre_norm(x)))`` (AXLearn hybridnorm)
    """

    attn_norm: RMSNorm
    attention: Attention
    pre_norm: RMSNorm | None
    ffn: SwiGLU | MoE
    post_norm: RMSNorm | None
    kind: BlockKind = eqx.field(static=True)
    placement: str = eqx.field(static=True)

    def __init__(self, kind: BlockKind, config: ModelConfig, *, key: PRNGKeyArray):
        k_attn, k_ffn = jax.random.split(key)
        init, dim, placement = model_init(config), config.embed_dim, config.norm.ffn_placement
        norm = dict(eps=config.norm.eps, dtype=init.dtype, stats_dtype=config.norm.stats_dtype)
        self.attn_norm = RMSNorm(dim, **norm)
        self.attention = Attention(
            dim, config.attention, eps=config.norm.eps, stats_dtype=config.norm.stats_dtype, init=init, key=k_attn
        )
        norms = PLACEMENTS.get(placement)
        self.pre_norm = RMSNorm(dim, **norm) if norms.pre_norm else None
        self.post_norm = RMSNorm(dim, **norm) if norms.post_norm else None
        if kind == "moe":
            assert config.moe is not None
            self.ffn = MoE(dim, config.moe, init=init, key=k_ffn)
        else:
            assert config.mlp_dim is not None
            self.ffn = SwiGLU(dim, config.mlp_dim, init=init, key=k_ffn)
        self.kind = kind
        self.placement = placement

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        cos: Float[Array, "batch seq rotary_dim"],
        sin: Float[Array, "batch seq rotary_dim"],
        mask: AttentionMask,
        token_mask: Bool[Array, "batch seq"],
        token_domains: Float[Array, "batch seq domains"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], RouterStats | None]:
        """``key``: randomness of training-time LoRA dropout (None: none)."""
        attention_key, ffn_key = (None, None) if key is None else jax.random.split(key)
        x = x + self.attention(self.attn_norm(x), cos, sin, mask, attention_key)
        return self._ffn_residual(x, token_mask, token_domains, segment_ids, key=ffn_key)

    def decode(
        self,
        x: Float[Array, "batch seq embed"],
        cos: Float[Array, "batch seq rotary_dim"],
        sin: Float[Array, "batch seq rotary_dim"],
        mask: AttentionMask,
        token_mask: Bool[Array, "batch seq"],
        cache: LayerCache,
        index: Int[Array, ""],
    ) -> tuple[Float[Array, "batch seq embed"], RouterStats | None, LayerCache]:
        """The block on ``seq`` new tokens with a KV cache (see :meth:`Attention.decode`).

        The MoE routes the step's ``batch * seq`` tokens as configured, capacity included. When they do
        not split into ``RouterConfig.num_groups`` equal groups (one token per step, say) the step is
        flattened into one row and padded with masked tokens up to the next multiple of ``num_groups``;
        padding takes no expert capacity and is left out of the router statistics.
        """
        attended, cache = self.attention.decode(self.attn_norm(x), cos, sin, mask, cache, index)
        x, stats = self._ffn_residual(x + attended, token_mask, pad_to_groups=True)
        return x, stats, cache

    def _ffn_residual(
        self,
        x: Float[Array, "batch seq embed"],
        token_mask: Bool[Array, "batch seq"],
        token_domains: Float[Array, "batch seq domains"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
        pad_to_groups: bool = False,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], RouterStats | None]:
        h = self.pre_norm(x) if self.pre_norm is not None else x
        if isinstance(self.ffn, MoE):
            if pad_to_groups:
                h, stats = _moe_padded(self.ffn, h, token_mask)
            else:
                h, stats = self.ffn(h, token_mask, token_domains, segment_ids, key=key)
        else:
            h, stats = self.ffn(h, key), None
        return PLACEMENTS.get(self.placement).residual(x, h, self.post_norm), stats


def _moe_padded(
    moe: MoE, h: Float[Array, "batch seq embed"], token_mask: Bool[Array, "batch seq"]
) -> tuple[Float[Array, "batch seq embed"], RouterStats]:
    """``moe(h, token_mask)``, padding the tokens with masked ones to a multiple of ``num_groups``."""
    batch, seq, embed = h.shape
    tokens = batch * seq
    pad = -tokens % moe.config.router.num_groups
    if pad == 0:
        return moe(h, token_mask)
    flat = jnp.concatenate([h.reshape(1, tokens, embed), jnp.zeros((1, pad, embed), h.dtype)], axis=1)
    flat_mask = jnp.concatenate([token_mask.reshape(1, tokens), jnp.zeros((1, pad), bool)], axis=1)
    out, stats = moe(flat, flat_mask)
    return out[:, :tokens].reshape(batch, seq, embed), stats
