"""Segments of repeated blocks, initialised with ``eqx.filter_vmap`` and run with ``lax.scan``."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from eqmoe.config import ModelConfig, Segment
from eqmoe.nn.block import Block
from eqmoe.nn.context import Context
from eqmoe.nn.router import Routing
from eqmoe.params import Layer

# Outputs of kernels that are not XLA dots (Pallas, custom VJPs), named where they are made so that "dots" keeps them.
KERNEL_OUTPUTS = ("attention", "experts")
_checkpoint = jax.checkpoint_policies
# What each ModelConfig.remat keeps for the backward pass (None: no rematerialisation; "auto" runs as "none" until the
# training loop resolves it).
REMAT_POLICIES = {
    "none": None,
    "auto": None,
    "dots": _checkpoint.save_from_both_policies(
        _checkpoint.dots_with_no_batch_dims_saveable, _checkpoint.save_only_these_names(*KERNEL_OUTPUTS)
    ),
    "offload": _checkpoint.save_and_offload_only_these_names(
        names_which_can_be_saved=(),
        names_which_can_be_offloaded=KERNEL_OUTPUTS,
        offload_src="device",
        offload_dst="pinned_host",
    ),
    "block": _checkpoint.nothing_saveable,
}


def interleave_routings(per_position: tuple[Routing, ...]) -> Routing | None:
    """Routings of a unit's routed blocks, each ``[repeats, ...]``, in layer order ``[repeats * n, ...]``."""
    if not per_position:
        return None
    return jax.tree.map(lambda *xs: jnp.stack(xs, axis=1).reshape(-1, *xs[0].shape[1:]), *per_position)


@jax.custom_vjp
def _unstack(stacked: Array) -> tuple[Array, ...]:
    """``stacked``'s slices along its first axis. Its gradient is one stack of the slices' gradients: the slices'
    own (``stacked[i]``) would each scatter into a zero-filled array of the whole stack, and those be added."""
    return tuple(stacked[i] for i in range(stacked.shape[0]))


def _unstack_forward(stacked):
    return _unstack(stacked), None


def _unstack_backward(_, gradients):
    return (jnp.stack(gradients),)


_unstack.defvjp(_unstack_forward, _unstack_backward)


def unroll_of(repeats: int, config: ModelConfig) -> int:
    """The repeats a scan runs per iteration: all of them for a stack of at most ``config.scan_unroll`` without
    recomputation, else one (unrolled, a recomputing policy's step kept more than the policy keeps: XLA can reuse
    the forward values the recomputation was to replace)."""
    return repeats if repeats <= config.scan_unroll and REMAT_POLICIES.get(config.remat) is None else 1


class RepeatedUnit(Layer):
    """``repeats`` copies of a unit of blocks; every array leaf carries a leading ``repeats`` axis.

    Run as one ``lax.scan`` over that axis, so the program holds one copy of the unit whatever the
    depth. ``scan=False`` runs the same parameters in a Python loop (a check, a debugging aid, and on a CPU a faster
    train step for a shallow model: its backward pass neither zero-fills stacked buffers nor slices them).

    With a decoding cache the cache holds one entry per block of the unit, each the block's attention kind's own
    cache with a leading ``repeats`` axis like the parameters; the scan runs over the unit's parameters and its
    cache together and returns the updated cache as a scan output, beside the routing of each routed block.
    """

    blocks: tuple[Block, ...]
    repeats: int = eqx.field(static=True)
    scan: bool = eqx.field(static=True)
    unroll: int = eqx.field(static=True)
    remat: str = eqx.field(static=True)

    def __init__(self, segment: Segment, config: ModelConfig, *, key: PRNGKeyArray):
        def make_unit(unit_key):
            keys = jax.random.split(unit_key, len(segment.unit))
            return tuple(Block(kind, config, key=k) for kind, k in zip(segment.unit, keys, strict=True))

        self.blocks = eqx.filter_vmap(make_unit)(jax.random.split(key, segment.repeats))
        self.repeats = segment.repeats
        self.scan = config.scan_layers
        self.unroll = unroll_of(segment.repeats, config)
        self.remat = config.remat

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        context: Context,
        cache: tuple[Any, ...] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], Routing | None, tuple[Any, ...] | None]:
        """Every repeat of the unit in order. Returns ``x``, the routing of the unit's routed blocks in layer
        order (``None`` without any) and the updated cache (``None`` without one)."""
        if cache is not None and len(cache) != len(self.blocks):
            raise ValueError(f"the cache has {len(cache)} entries for a unit of {len(self.blocks)} blocks")
        params, static = eqx.partition(self.blocks, eqx.is_array)
        keys = None if key is None else jax.random.split(key, self.repeats)  # one per repeat, scanned

        def run_unit(x, inputs):
            unit_params, unit_cache, unit_key = inputs
            routings, new_cache = [], []
            for position, block in enumerate(eqx.combine(unit_params, static)):
                layer_cache = None if unit_cache is None else unit_cache[position]
                block_key = None if unit_key is None else jax.random.fold_in(unit_key, position)
                x, routing, layer_cache = block(x, context, layer_cache, block_key)
                if routing is not None:
                    routings.append(routing)
                new_cache.append(layer_cache)
            return x, (tuple(routings), None if unit_cache is None else tuple(new_cache))

        policy = REMAT_POLICIES.get(self.remat)
        if policy is not None:
            run_unit = jax.checkpoint(run_unit, policy=policy)
        if self.scan:
            x, (routings, cache) = jax.lax.scan(run_unit, x, (params, cache, keys), unroll=self.unroll)
        else:
            leaves, tree = jax.tree.flatten((params, cache, keys))
            sliced = [_unstack(leaf) if jnp.issubdtype(leaf.dtype, jnp.inexact) else leaf for leaf in leaves]
            outputs = []
            for index in range(self.repeats):
                x, unit_outputs = run_unit(x, tree.unflatten([parts[index] for parts in sliced]))
                outputs.append(unit_outputs)
            routings, cache = jax.tree.map(lambda *xs: jnp.stack(xs), *outputs)
        return x, interleave_routings(routings), cache
