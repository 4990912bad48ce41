"""The decoder block: its layer kind's attention, then its FFN with the configured norm placement."""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from eqmoe.config import LayerKind, ModelConfig
from eqmoe.nn._init import Init
from eqmoe.nn.context import Context
from eqmoe.nn.kinds import AttentionKind, FFNKind, build_attention, build_ffn
from eqmoe.nn.norm import RMSNorm
from eqmoe.nn.router import Routing
from eqmoe.params import Layer
from eqmoe.registries import NORM_PLACEMENTS


def model_init(config: ModelConfig) -> Init:
    """The weight initialisation ``config`` asks for."""
    return Init(config.init, config.init_std, jnp.dtype(config.param_dtype))


class Placement(NamedTuple):
    """Where the FFN's norms sit (``NormConfig.ffn_placement``, registered in
    :data:`eqmoe.registries.NORM_PLACEMENTS`).

    **Arguments:**

    - `pre_norm`: whether the FFN reads ``pre_norm(x)`` (else ``x`` itself).
    - `post_norm`: whether the block has a second norm, ``post_norm``.
    - `residual`: ``residual(x, h, post_norm) -> x'``, the residual stream ``x`` combined with the FFN
      output ``h`` (``post_norm`` is ``None`` when the placement has none).
    """

    pre_norm: bool
    post_norm: bool
    residual: Callable[[Float[Array, "*b embed"], Float[Array, "*b embed"], RMSNorm | None], Float[Array, "*b embed"]]


PLACEMENTS = NORM_PLACEMENTS
PLACEMENTS.register("pre", Placement(True, False, lambda x, h, post_norm: x + h))
PLACEMENTS.register("post", Placement(False, True, lambda x, h, post_norm: post_norm(x + h)))
PLACEMENTS.register("hybrid", Placement(True, True, lambda x, h, post_norm: x + post_norm(h)))


class Block(Layer):
    """``x += attention(attn_norm(x))`` then the FFN residual with ``NormConfig.ffn_placement``:

    - ``pre``: ``x + ffn(pre_norm(x))`` (HF Qwen3-MoE; ``pre_norm`` is ``post_attention_layernorm``)
    - ``post``: ``post_norm(x + ffn(x))``
    - ``hybrid``: ``x + post_norm(ffn(pre_norm(x)))`` (AXLearn hybridnorm)

    The attention and the FFN are the kinds its :class:`~eqmoe.config.LayerKind` names.
    """

    attn_norm: RMSNorm
    attention: AttentionKind
    pre_norm: RMSNorm | None
    ffn: FFNKind
    post_norm: RMSNorm | None
    kind: LayerKind = eqx.field(static=True)
    placement: str = eqx.field(static=True)

    def __init__(self, kind: LayerKind, config: ModelConfig, *, key: PRNGKeyArray):
        k_attn, k_ffn = jax.random.split(key)
        init, dim, placement = model_init(config), config.embed_dim, config.norm.ffn_placement
        self.attn_norm = RMSNorm.of(config.norm, dim, init.dtype)
        self.attention = build_attention(config, kind, init=init, key=k_attn)
        norms = PLACEMENTS.get(placement)
        self.pre_norm = RMSNorm.of(config.norm, dim, init.dtype) if norms.pre_norm else None
        self.post_norm = RMSNorm.of(config.norm, dim, init.dtype) if norms.post_norm else None
        self.ffn = build_ffn(config, kind, init=init, key=k_ffn)
        self.kind = kind
        self.placement = placement

    def __call__(
        self, x: Float[Array, "batch seq embed"], context: Context, cache: Any = None, key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, "batch seq embed"], Routing | None, Any]:
        """The block on ``x``; with ``cache`` (this layer's decoding cache entry) the attention reads and writes it
        and the updated entry comes back. ``key``: training-time randomness (adapter dropout)."""
        attention_key, ffn_key = (None, None) if key is None else jax.random.split(key)
        attended, cache = self.attention(self.attn_norm(x), context, cache, attention_key)
        x = x + attended
        h = self.pre_norm(x) if self.pre_norm is not None else x
        h, routing = self.ffn(h, context, key=ffn_key)
        return PLACEMENTS.get(self.placement).residual(x, h, self.post_norm), routing, cache
