"""The language model: embed -> scanned segments of layers -> final norm -> logits."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqmoe import parallel
from eqmoe.config import ModelConfig, segments
from eqmoe.config_io import architecture_differences, format_differences
from eqmoe.nn.block import model_init
from eqmoe.nn.context import Context, attention_mask, cache_mask, causal_mask
from eqmoe.nn.fp8 import is_block_fp8
from eqmoe.nn.linear import Linear
from eqmoe.nn.mtp import MTPLayer, predict_ahead
from eqmoe.nn.norm import RMSNorm
from eqmoe.nn.router import Routing
from eqmoe.nn.routing_stats import RouterStats, layer_stats
from eqmoe.nn.stack import RepeatedUnit
from eqmoe.params import Layer, Role, param
from eqmoe.registries import ATTENTION_KINDS, check_names


class KVCache(eqx.Module):
    """Every attention layer's decoding cache (see ``eqmoe.inference``).

    ``layers[s][j]`` belongs to block ``j`` of segment ``s``'s repeat unit: whatever its attention kind keeps
    (grouped-query attention: keys and values ``[repeats, batch, kv_heads, max_len, head_dim]``; a recurrent kind:
    its state), stacked like the parameters, so each segment's scan runs over its parameters and its cache
    together. Slots are written in order: ``index`` is the next free slot (the same for every row) and
    ``valid[b, t]`` marks slots holding a real token (false for slots not yet written and for padding). Build one
    with :meth:`Transformer.init_cache`.
    """

    layers: tuple[tuple[Any, ...], ...]
    valid: Bool[Array, "batch max_len"]
    index: Int[Array, ""]

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]


class ModelOutput(eqx.Module):
    """What a call returns: the logits, every MoE layer's routing in layer order (leading axis: MoE layers;
    ``None`` without any), the updated cache when called with one, the token facts the routing statistics
    need (:attr:`aux`), and, when the objective trains them (``LossConfig.mtp_weight``), the multi-token-prediction
    layers' logits (depth ``k`` at position ``i`` predicts token ``i + k + 1``)."""

    logits: Float[Array, "batch seq vocab"] | None  # None: called with logits=False
    routing: Routing | None
    cache: KVCache | None = None
    token_mask: Bool[Array, "batch seq"] | None = None
    segment_ids: Int[Array, "batch seq"] | None = None
    mtp_logits: Float[Array, "depth batch seq vocab"] | None = None
    hidden: Float[Array, "batch seq embed"] | None = None  # the final norm's output, when the logits are left out
    num_groups: int = eqx.field(static=True, default=1)
    balance_micro_batch_rows: int = eqx.field(static=True, default=1)

    @property
    def aux(self) -> RouterStats | None:
        """Every MoE layer's :class:`RouterStats` over the call's real tokens (per packed document for the
        per-sequence balance), computed from :attr:`routing`."""
        return self.stats()

    def stats(self, token_domains: Float[Array, "batch seq domains"] | None = None) -> RouterStats | None:
        """:attr:`aux`, with per-domain assignment counts when ``token_domains`` (one-hot per token) is given."""
        if self.routing is None:
            return None
        return layer_stats(
            self.routing,
            self.token_mask,
            self.num_groups,
            token_domains,
            self.segment_ids,
            self.balance_micro_batch_rows,
        )


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
    - ``cache``: a :class:`KVCache` for autoregressive decoding. The tokens are written into slots
      ``cache.index ..`` and attend to every earlier filled slot (a query in slot ``p`` sees the valid
      slots ``<= p``); the output carries the updated cache. ``positions`` then defaults to each
      row's count of real tokens so far (``cache.index + 0..seq-1`` without padding, and HF's
      positions for left-padded prompts). ``segment_ids`` are not supported with a cache. The cache
      must have room: ``cache.index + seq <= max_len`` (not checked inside ``jit``; a write past the end
      lands on the last slots).
    - ``key``: training-time randomness (LoRA dropout); ``None`` (evaluation, generation) is deterministic.
    """

    embed: Float[Array, "vocab embed"] = param(Role.EMBEDDING)
    segments: tuple[RepeatedUnit, ...]
    final_norm: RMSNorm
    lm_head: Float[Array, "embed vocab"] | None = param(Role.OUTPUT)
    mtp: tuple[MTPLayer, ...]
    config: ModelConfig = eqx.field(static=True)

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        check_names(config)
        stack = segments(config.layers)
        k_embed, k_head, *k_segments = jax.random.split(key, 2 + len(stack))
        init = model_init(config)
        self.embed = init.embedding(k_embed, config.vocab_size, config.embed_dim)
        self.segments = tuple(
            RepeatedUnit(segment, config, key=k) for segment, k in zip(stack, k_segments, strict=True)
        )
        self.final_norm = RMSNorm.of(config.norm, config.embed_dim, init.dtype)
        self.lm_head = (
            None
            if config.tie_embeddings
            else init.weight(k_head, (config.embed_dim, config.vocab_size), fan_in=config.embed_dim)
        )
        # keys of their own, so that a model without them draws exactly what it drew before they existed
        mtp_keys = jax.random.split(jax.random.fold_in(key, 2**20), config.mtp_layers)
        self.mtp = tuple(MTPLayer(config, key=k) for k in mtp_keys)
        self.config = config

    def __call__(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        segment_ids: Int[Array, "batch seq"] | None = None,
        positions: Int[Array, "batch seq"] | None = None,
        token_mask: Bool[Array, "batch seq"] | None = None,
        cache: KVCache | None = None,
        key: PRNGKeyArray | None = None,
        logits: bool = True,
    ) -> ModelOutput:
        """``logits=False`` leaves the output layer to the caller: ``logits`` is ``None`` and ``hidden`` holds the final
        norm's output (a loss that takes the vocabulary in chunks, :func:`eqmoe.losses.next_token_losses_in_chunks`)."""
        model = self.cast(self.config.dtype)
        context = self._context(tokens, segment_ids, positions, token_mask, cache)
        x = parallel.constrain_activation(model.embed[tokens], ("batch", "seq", None))
        routings, caches = [], []
        for index, segment in enumerate(model.segments):
            segment_key = None if key is None else jax.random.fold_in(key, index)
            segment_cache = None if cache is None else cache.layers[index]
            x, routing, segment_cache = segment(x, context, segment_cache, segment_key)
            if routing is not None:
                routings.append(routing)
            caches.append(segment_cache)
        hidden = model.final_norm(x)
        output = parallel.constrain_activation(model.head(hidden), ("batch", "seq", "vocab")) if logits else None
        routing = jax.tree.map(lambda *xs: jnp.concatenate(xs), *routings) if routings else None
        new_cache, mtp_logits = None, None
        if cache is not None:
            new_cache = KVCache(tuple(caches), context.mask.key_valid, cache.index + tokens.shape[1])
        elif model.mtp and self.config.loss.mtp_weight > 0:
            mtp_key = None if key is None else jax.random.fold_in(key, len(model.segments))
            mtp_logits = predict_ahead(model.mtp, hidden, tokens, model.embed, model.head, context, mtp_key)
        moe = self.config.moe
        groups = 1 if moe is None or cache is not None else moe.router.num_groups
        return ModelOutput(
            output,
            routing,
            new_cache,
            context.token_mask,
            segment_ids,
            mtp_logits=mtp_logits,
            hidden=None if logits else hidden,
            num_groups=groups,
            balance_micro_batch_rows=self.config.loss.balance_micro_batch_rows,
        )

    def _context(self, tokens, segment_ids, positions, token_mask, cache: KVCache | None) -> Context:
        """The call's :class:`~eqmoe.nn.context.Context`: positions, real tokens, documents and the mask."""
        batch, seq = tokens.shape
        given_mask = token_mask
        if token_mask is None:
            token_mask = jnp.ones((batch, seq), bool)
        if cache is None:
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
            if segment_ids is None and given_mask is None:
                return Context(positions, token_mask, jnp.zeros((batch, seq), jnp.int32), causal_mask(batch, seq))
            segments_ = jnp.zeros((batch, seq), jnp.int32) if segment_ids is None else segment_ids
            return Context(positions, token_mask, segments_, attention_mask(segments_, token_mask))
        if segment_ids is not None:
            raise ValueError("segment_ids are not supported with a KV cache (decode one document per row)")
        if cache.valid.shape[0] != batch:
            raise ValueError(f"the cache holds {cache.valid.shape[0]} rows but tokens has {batch}")
        if len(cache.layers) != len(self.segments):
            raise ValueError(f"the cache has {len(cache.layers)} segments, the model {len(self.segments)}")
        valid = jax.lax.dynamic_update_slice(cache.valid, token_mask, (0, cache.index))
        if positions is None:
            seen = jnp.sum(cache.valid, axis=1, dtype=jnp.int32)[:, None]
            positions = jnp.maximum(seen + jnp.cumsum(token_mask, axis=1, dtype=jnp.int32) - 1, 0)
        zeros = jnp.zeros((batch, seq), jnp.int32)
        return Context(positions, token_mask, zeros, cache_mask(cache.index, seq, valid), cache.index)

    def init_cache(self, batch: int, max_len: int, dtype: str | None = None) -> KVCache:
        """An empty :class:`KVCache` with ``max_len`` slots per row, in ``dtype`` (default: the compute dtype):
        each layer's entry is what its attention kind keeps, stacked over the repeats of its segment."""
        if batch < 1 or max_len < 1:
            raise ValueError(f"init_cache: batch={batch} and max_len={max_len} must be positive")
        config = self.config
        dtype = jnp.dtype(dtype or config.dtype)

        def entry(kind, repeats: int):
            one = ATTENTION_KINDS.get(kind.attention).init_cache(config, kind, batch, max_len, dtype)
            return jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (repeats, *leaf.shape)), one)

        layers = tuple(tuple(entry(kind, unit.repeats) for kind in unit.unit) for unit in segments(config.layers))
        return KVCache(layers, jnp.zeros((batch, max_len), bool), jnp.zeros((), jnp.int32))

    def output_logits(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq vocab"]:
        """The final norm and the output layer (``lm_head``, or the embedding when tied)."""
        return self.head(self.final_norm(x))

    def head(self, normed: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq vocab"]:
        """The output layer on normed states (``lm_head``, or the embedding when tied)."""
        batch, seq, _ = normed.shape
        # A flat [tokens, embed] matmul: XLA:CPU's backward pass is about twice as slow on [batch, seq, embed].
        flat = normed.reshape(batch * seq, -1)
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
        match. Parameters are not cast, and every matrix keeps what it carries (LoRA adapters). A ``ValueError``
        names every other differing field."""
        differences = [d for d in architecture_differences(self.config, config) if d[0] not in allow]
        if differences:
            raise ValueError(f"with_config: another architecture: {format_differences(differences, 'model', 'new')}")
        abstract = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
        is_linear = lambda node: isinstance(node, Linear)  # noqa: E731
        old, _ = jax.tree.flatten(self, is_leaf=is_linear)
        new, structure = jax.tree.flatten(abstract, is_leaf=is_linear)
        shape = lambda node: jnp.shape(node.weight) if is_linear(node) else jax.tree.map(jnp.shape, node)  # noqa: E731
        shapes = [shape(leaf) for leaf in old]  # a block-FP8 weight has its weight's shape
        if len(old) != len(new) or shapes != [shape(x) for x in new]:
            raise ValueError("with_config: the new config describes different parameter shapes")
        return jax.tree.unflatten(structure, old)

    def cast(self, dtype: str) -> "Transformer":
        """This model with every floating parameter in ``dtype`` (the compute copy)."""
        target = jnp.dtype(dtype)

        def convert(leaf):
            if eqx.is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype != target:
                return leaf.astype(target)
            return leaf

        return jax.tree.map(convert, self, is_leaf=is_block_fp8)  # a block-FP8 weight stays as held
