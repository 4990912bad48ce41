"""The language model: embed -> scanned segments -> final norm -> logits."""

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqmoe import parallel
from eqmoe.config import ModelConfig
from eqmoe.config_io import architecture_differences, format_differences
from eqmoe.nn._params import Layer, Role, param
from eqmoe.nn.attention import LayerCache, attention_mask, cache_mask, causal_mask
from eqmoe.nn.block import model_init
from eqmoe.nn.norm import RMSNorm
from eqmoe.nn.rope import rope_tables
from eqmoe.nn.router import RouterStats
from eqmoe.nn.stack import RepeatedUnit


class KVCache(eqx.Module):
    """Keys and values of every attention block for autoregressive decoding (see ``eqmoe.inference``).

    ``layers[s][j]`` belongs to block ``j`` of segment ``s``'s repeat unit; its leaves are
    ``[repeats, batch, kv_heads, max_len, head_dim]``, stacked like the parameters, so each segment's
    scan runs over its parameters and its cache together. Slots are written in order: ``index`` is
    the next free slot (the same for every row) and ``valid[b, t]`` marks slots holding a real token
    (false for slots not yet written and for padding). Build one with ``eqmoe.inference.init_cache``.
    """

    layers: tuple[tuple[LayerCache, ...], ...]
    valid: Bool[Array, "batch max_len"]
    index: Int[Array, ""]

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]


class ModelOutput(NamedTuple):
    logits: Float[Array, "batch seq vocab"]
    aux: RouterStats | None  # per MoE layer, in layer order: leading axis = number of MoE layers
    cache: KVCache | None = None  # the updated cache when the model was called with one


class Transformer(Layer):
    """A decoder-only MoE language model described entirely by a :class:`ModelConfig`.

    **Arguments** of ``__call__``:

    - ``tokens``: token ids ``[batch, seq]``.
    - ``segment_ids``: document id of each token for packed rows (``1, 2, ...`` per row, as packing makes them);
      attention never crosses documents and the router statistics' per-sequence balance is taken per
      document. Without them each row is one document.
    - ``positions``: RoPE positions (default ``0..seq-1`` in every row).
    - ``token_mask``: false at padding; those keys are masked out and those tokens excluded from the
      router statistics (HF's ``attention_mask``).
    - ``token_domains``: a one-hot domain label per token ``[batch, seq, domains]``; the router
      statistics then carry ``domain_counts`` (for expert-domain mutual information).
    - ``cache``: a :class:`KVCache` for autoregressive decoding. The tokens are written into slots
      ``cache.index ..`` and attend to every earlier filled slot (a query in slot ``p`` sees the valid
      slots ``<= p``); the output carries the updated cache. ``positions`` then defaults to each
      row's count of real tokens so far (``cache.index + 0..seq-1`` without padding, and HF's
      positions for left-padded prompts). ``segment_ids`` are not supported with a cache. The cache
      must have room: ``cache.index + seq <= max_len`` (not checked inside ``jit``; a write past the end
      lands on the last slots). MoE routing follows :meth:`eqmoe.nn.block.Block.decode`.
    - ``key``: training-time randomness (LoRA dropout); ``None`` (evaluation, generation) is deterministic.
    """

    embed: Float[Array, "vocab embed"] = param(Role.EMBEDDING)
    segments: tuple[RepeatedUnit, ...]
    final_norm: RMSNorm
    lm_head: Float[Array, "embed vocab"] | None = param(Role.OUTPUT)
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
        token_domains: Float[Array, "batch seq domains"] | None = None,
        cache: KVCache | None = None,
        key: PRNGKeyArray | None = None,
    ) -> ModelOutput:
        model = self.cast(self.config.dtype)
        batch, seq = tokens.shape
        given_mask = token_mask
        if token_mask is None:
            token_mask = jnp.ones((batch, seq), bool)
        if cache is not None:
            if segment_ids is not None:
                raise ValueError("segment_ids are not supported with a KV cache (decode one document per row)")
            if token_domains is not None:
                raise ValueError("token_domains are not supported with a KV cache")
            if cache.valid.shape[0] != batch:
                raise ValueError(f"the cache holds {cache.valid.shape[0]} rows but tokens has {batch}")
            if len(cache.layers) != len(self.segments):
                raise ValueError(f"the cache has {len(cache.layers)} segments, the model {len(self.segments)}")
            valid = jax.lax.dynamic_update_slice(cache.valid, token_mask, (0, cache.index))
            if positions is None:
                seen = jnp.sum(cache.valid, axis=1, dtype=jnp.int32)[:, None]
                positions = jnp.maximum(seen + jnp.cumsum(token_mask, axis=1, dtype=jnp.int32) - 1, 0)
            mask = cache_mask(cache.index, seq, valid)
        else:
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
            if segment_ids is None and given_mask is None:
                mask = causal_mask(batch, seq)
            else:
                segments = jnp.zeros((batch, seq), jnp.int32) if segment_ids is None else segment_ids
                mask = attention_mask(segments, token_mask)

        attn = self.config.attention
        cos, sin = rope_tables(
            positions,
            attn.rotary_dim or attn.head_dim,
            attn.rope_theta,
            self.config.dtype,
            attn.rope_layout,
            attn.rope_scaling,
        )
        x = parallel.constrain_activation(model.embed[tokens], ("batch", "seq", None))
        layer_stats, layer_caches = [], []
        for index, segment in enumerate(model.segments):
            if cache is None:
                segment_key = None if key is None else jax.random.fold_in(key, index)
                x, stats = segment(x, cos, sin, mask, token_mask, token_domains, segment_ids, key=segment_key)
            else:
                x, stats, segment_cache = segment.decode(
                    x, cos, sin, mask, token_mask, cache.layers[index], cache.index
                )
                layer_caches.append(segment_cache)
            if stats is not None:
                layer_stats.append(stats)
        logits = parallel.constrain_activation(model.output_logits(x), ("batch", "seq", "vocab"))
        aux = jax.tree.map(lambda *xs: jnp.concatenate(xs), *layer_stats) if layer_stats else None
        if cache is None:
            return ModelOutput(logits, aux)
        return ModelOutput(logits, aux, KVCache(tuple(layer_caches), valid, cache.index + seq))

    def output_logits(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq vocab"]:
        """The final norm and the output layer (``lm_head``, or the embedding when tied)."""
        batch, seq, _ = x.shape
        # A flat [tokens, embed] matmul: XLA:CPU's backward pass is about twice as slow on [batch, seq, embed].
        flat = self.final_norm(x).reshape(batch * seq, -1)
        if self.lm_head is not None:
            logits = flat @ self.lm_head
        else:
            logits = flat @ self.embed.T
            if self.config.tied_logit_scale == "rsqrt_embed":
                logits = logits * self.config.embed_dim**-0.5
        return logits.reshape(batch, seq, -1)

    def with_config(self, config: ModelConfig, *, allow: tuple[str, ...] = ()) -> "Transformer":
        """These parameters under ``config``, which must have this model's architecture
        (:func:`eqmoe.config_io.architecture_differences`): it may change the execution and objective fields
        (``remat``, ``dtype``, the dispatch backend, loss weights). ``allow`` names architecture fields
        that may differ too, for callers that change them on purpose (``dropless`` drops the capacity;
        a loader that has cast the parameters sets ``param_dtype``); the parameter shapes must still
        match. Parameters are not cast. A ``ValueError`` names every other differing field."""
        from eqmoe import lora  # adapters ride along: the new config describes the layers they sit beside

        if lora.has_lora(self):
            bare, adapters = lora.split_adapters(self)
            return lora.put_adapters(bare.with_config(config, allow=allow), adapters)
        differences = [d for d in architecture_differences(self.config, config) if d[0] not in allow]
        if differences:
            raise ValueError(f"with_config: another architecture: {format_differences(differences, 'model', 'new')}")
        abstract = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
        if [x.shape for x in jax.tree.leaves(self)] != [x.shape for x in jax.tree.leaves(abstract)]:
            raise ValueError("with_config: the new config describes different parameter shapes")
        return jax.tree.unflatten(jax.tree.structure(abstract), jax.tree.leaves(self))

    def cast(self, dtype: str) -> "Transformer":
        """This model with every floating parameter in ``dtype`` (the compute copy)."""
        target = jnp.dtype(dtype)

        def convert(leaf):
            if eqx.is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype != target:
                return leaf.astype(target)
            return leaf

        return jax.tree.map(convert, self)
