"""Building single parts for the tests that exercise one of them alone."""

import jax.numpy as jnp

from eqmoe.config import AttentionConfig, LayerKind, ModelConfig, NormConfig
from eqmoe.nn._init import Init
from eqmoe.nn.context import Context
from eqmoe.nn.gqa import GroupedQueryAttention


def gqa(
    embed: int,
    config: AttentionConfig,
    *,
    key,
    eps: float = 1e-6,
    stats_dtype: str = "float32",
    init: Init | None = None,
    window: int | None = None,
) -> GroupedQueryAttention:
    """The ``gqa`` attention kind for a model of width ``embed`` with these attention settings."""
    model = ModelConfig(
        vocab_size=8,
        embed_dim=embed,
        attention=config,
        layers=("dense",),
        mlp_dim=8,
        norm=NormConfig(eps=eps, stats_dtype=stats_dtype),
    )
    init = init or Init("normal", 0.02, jnp.dtype("float32"))
    return GroupedQueryAttention(model, LayerKind(ffn="dense", window=window), init=init, key=key)


def context(mask, positions=None) -> Context:
    """A training call's context for ``mask`` (an AttentionMask), positions ``0..seq-1`` unless given."""
    batch, seq = mask.query_segment.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    return Context(positions, mask.key_valid, mask.query_segment, mask)
