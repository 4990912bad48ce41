"""Segments of repeated blocks, initialised with ``eqx.filter_vmap`` and run with ``lax.scan``."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray

from eqmoe.config import ModelConfig, Segment
from eqmoe.nn._params import Layer
from eqmoe.nn.attention import AttentionMask, LayerCache
from eqmoe.nn.block import Block
from eqmoe.nn.router import RouterStats


def _interleave(per_position: tuple[RouterStats, ...]) -> RouterStats | None:
    """Stats of a unit's MoE blocks, each ``[repeats, ...]``, in layer order ``[repeats * n, ...]``."""
    if not per_position:
        return None
    return jax.tree.map(lambda *xs: jnp.stack(xs, axis=1).reshape(-1, *xs[0].shape[1:]), *per_position)


class RepeatedUnit(Layer):
    """``repeats`` copies of a unit of blocks; every array leaf carries a leading ``repeats`` axis.

    Run as one ``lax.scan`` over that axis, so the program holds one copy of the unit whatever the
    depth. ``scan=False`` runs the same parameters in a Python loop (a check and a debugging aid).

    With a KV cache (:meth:`decode`) the cache holds one :class:`LayerCache` per block of the unit, each
    leaf ``[repeats, batch, kv_heads, max_len, head_dim]`` like the parameters; the scan runs over the
    unit's parameters and its cache together and returns the updated cache as a scan output.
    """

    blocks: tuple[Block, ...]
    repeats: int = eqx.field(static=True)
    scan: bool = eqx.field(static=True)
    remat: bool = eqx.field(static=True)

    def __init__(self, segment: Segment, config: ModelConfig, *, key: PRNGKeyArray):
        def make_unit(unit_key):
            keys = jax.random.split(unit_key, len(segment.unit))
            return tuple(Block(kind, config, key=k) for kind, k in zip(segment.unit, keys, strict=True))

        self.blocks = eqx.filter_vmap(make_unit)(jax.random.split(key, segment.repeats))
        self.repeats = segment.repeats
        self.scan = config.scan_layers
        self.remat = config.remat == "block"

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
        def run_block(block, x, _, block_key):
            x, stats = block(x, cos, sin, mask, token_mask, token_domains, segment_ids, key=block_key)
            return x, stats, None

        keys = None if key is None else jax.random.split(key, self.repeats)  # one per repeat, scanned
        x, stats, _ = self._run(run_block, x, None, keys)
        return x, _interleave(stats)

    def decode(
        self,
        x: Float[Array, "batch seq embed"],
        cos: Float[Array, "batch seq rotary_dim"],
        sin: Float[Array, "batch seq rotary_dim"],
        mask: AttentionMask,
        token_mask: Bool[Array, "batch seq"],
        cache: tuple[LayerCache, ...],
        index: Int[Array, ""],
    ) -> tuple[Float[Array, "batch seq embed"], RouterStats | None, tuple[LayerCache, ...]]:
        """The segment on ``seq`` new tokens with its KV cache (one entry per block of the unit)."""
        if len(cache) != len(self.blocks):
            raise ValueError(f"the cache has {len(cache)} entries for a unit of {len(self.blocks)} blocks")

        def run_block(block, x, layer_cache, _):
            return block.decode(x, cos, sin, mask, token_mask, layer_cache, index)

        x, stats, cache = self._run(run_block, x, cache)
        return x, _interleave(stats), cache

    def _run(
        self,
        run_block: Callable,
        x: Float[Array, "batch seq embed"],
        cache: tuple[LayerCache, ...] | None,
        keys: Key[Array, " repeats"] | None = None,
    ):
        """Every repeat of the unit in order: ``run_block(block, x, layer_cache, key) -> (x, stats, layer_cache)``
        (``keys``: one per repeat, each block of the unit folding in its position).

        The scan's inputs are the unit's parameters and (when given) its cache; its outputs are the
        stats of the MoE blocks and the updated cache, both stacked over ``repeats``.
        """
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def run_unit(x, inputs):
            unit_params, unit_cache, unit_key = inputs
            stats, new_cache = [], []
            for position, block in enumerate(eqx.combine(unit_params, static)):
                layer_cache = None if unit_cache is None else unit_cache[position]
                block_key = None if unit_key is None else jax.random.fold_in(unit_key, position)
                x, block_stats, layer_cache = run_block(block, x, layer_cache, block_key)
                if block_stats is not None:
                    stats.append(block_stats)
                new_cache.append(layer_cache)
            return x, (tuple(stats), None if unit_cache is None else tuple(new_cache))

        if self.remat:
            run_unit = jax.checkpoint(run_unit)
        if self.scan:
            x, (stats, cache) = jax.lax.scan(run_unit, x, (params, cache, keys))
        else:
            outputs = []
            for index in range(self.repeats):
                x, unit_outputs = run_unit(x, jax.tree.map(lambda leaf, i=index: leaf[i], (params, cache, keys)))
                outputs.append(unit_outputs)
            stats, cache = jax.tree.map(lambda *xs: jnp.stack(xs), *outputs)
        return x, stats, cache
