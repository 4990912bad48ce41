"""The language model: embed -> scanned segments -> final norm -> logits."""

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqmoe.config import ModelConfig
from eqmoe.nn.attention import attention_mask
from eqmoe.nn.block import model_init
from eqmoe.nn.norm import RMSNorm
from eqmoe.nn.rope import rope_tables
from eqmoe.nn.router import RouterStats
from eqmoe.nn.stack import RepeatedUnit


class ModelOutput(NamedTuple):
    logits: Float[Array, "batch seq vocab"]
    aux: RouterStats | None  # per MoE layer, in layer order: leading axis = number of MoE layers


class Transformer(eqx.Module):
    """A decoder-only MoE language model described entirely by a :class:`ModelConfig`.

    **Arguments** of ``__call__``:

    - ``tokens``: token ids ``[batch, seq]``.
    - ``segment_ids``: document id of each token for packed rows; attention never crosses documents.
    - ``positions``: RoPE positions (default ``0..seq-1`` in every row).
    - ``token_mask``: false at padding; those keys are masked out and those tokens excluded from the
      router statistics (HF's ``attention_mask``).
    """

    embed: Float[Array, "vocab embed"]
    segments: tuple[RepeatedUnit, ...]
    final_norm: RMSNorm
    lm_head: Float[Array, "embed vocab"] | None
    config: ModelConfig = eqx.field(static=True)

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        k_embed, k_head, *k_segments = jax.random.split(key, 2 + len(config.layers))
        init = model_init(config)
        self.embed = init.embedding(k_embed, config.vocab_size, config.embed_dim)
        self.segments = tuple(
            RepeatedUnit(segment, config, key=k) for segment, k in zip(config.layers, k_segments, strict=True)
        )
        self.final_norm = RMSNorm(
            config.embed_dim, eps=config.norm.eps, dtype=init.dtype, stats_dtype=config.norm.stats_dtype
        )
        self.lm_head = (
            None
            if config.tie_embeddings
            else init.weight(k_head, (config.embed_dim, config.vocab_size), fan_in=config.embed_dim)
        )
        self.config = config

    def __call__(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        segment_ids: Int[Array, "batch seq"] | None = None,
        positions: Int[Array, "batch seq"] | None = None,
        token_mask: Bool[Array, "batch seq"] | None = None,
    ) -> ModelOutput:
        model = self.cast(self.config.dtype)
        batch, seq = tokens.shape
        if segment_ids is None:
            segment_ids = jnp.zeros((batch, seq), jnp.int32)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        if token_mask is None:
            token_mask = jnp.ones((batch, seq), bool)

        attn = self.config.attention
        cos, sin = rope_tables(positions, attn.head_dim, attn.rope_theta, self.config.dtype, attn.rope_layout)
        mask = attention_mask(segment_ids, token_mask)
        x = model.embed[tokens]
        layer_stats = []
        for segment in model.segments:
            x, stats = segment(x, cos, sin, mask, token_mask)
            if stats is not None:
                layer_stats.append(stats)
        x = model.final_norm(x)
        if model.lm_head is not None:
            logits = x @ model.lm_head
        else:
            logits = x @ model.embed.T
            if self.config.tied_logit_scale == "rsqrt_embed":
                logits = logits * self.config.embed_dim**-0.5
        aux = jax.tree.map(lambda *xs: jnp.concatenate(xs), *layer_stats) if layer_stats else None
        return ModelOutput(logits, aux)

    def cast(self, dtype: str) -> "Transformer":
        """This model with every floating parameter in ``dtype`` (the compute copy)."""
        target = jnp.dtype(dtype)

        def convert(leaf):
            if eqx.is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype != target:
                return leaf.astype(target)
            return leaf

        return jax.tree.map(convert, self)
