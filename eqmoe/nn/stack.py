"""Segments of repeated blocks, initialised with ``eqx.filter_vmap`` and run with ``lax.scan``."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from eqmoe.config import ModelConfig, Segment
from eqmoe.nn.block import Block
from eqmoe.nn.router import RouterStats


def _interleave(per_position: tuple[RouterStats, ...]) -> RouterStats | None:
    """Stats of a unit's MoE blocks, each ``[repeats, ...]``, in layer order ``[repeats * n, ...]``."""
    if not per_position:
        return None
    return jax.tree.map(lambda *xs: jnp.stack(xs, axis=1).reshape(-1, *xs[0].shape[1:]), *per_position)


class RepeatedUnit(eqx.Module):
    """``repeats`` copies of a unit of blocks; every array leaf carries a leading ``repeats`` axis.

    Run as one ``lax.scan`` over that axis, so the program holds one copy of the unit whatever the
    depth. ``scan=False`` runs the same parameters in a Python loop (a check and a debugging aid).
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
        cos: Float[Array, "batch seq head_dim"],
        sin: Float[Array, "batch seq head_dim"],
        mask: Bool[Array, "batch seq seq"],
        token_mask: Bool[Array, "batch seq"],
    ) -> tuple[Float[Array, "batch seq embed"], RouterStats | None]:
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def run_unit(x, unit_params):
            stats = []
            for block in eqx.combine(unit_params, static):
                x, block_stats = block(x, cos, sin, mask, token_mask)
                if block_stats is not None:
                    stats.append(block_stats)
            return x, tuple(stats)

        if self.remat:
            run_unit = jax.checkpoint(run_unit)
        if self.scan:
            x, stats = jax.lax.scan(run_unit, x, params)
        else:
            outputs = []
            for index in range(self.repeats):
                x, unit_stats = run_unit(x, jax.tree.map(lambda leaf, i=index: leaf[i], params))
                outputs.append(unit_stats)
            stats = jax.tree.map(lambda *xs: jnp.stack(xs), *outputs) if outputs[0] else ()
        return x, _interleave(stats)
