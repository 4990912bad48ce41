"""Aux-loss-free load balancing (DeepSeek-V3): the routers' selection biases, moved outside the gradient.

After each optimizer step every MoE layer's bias moves by ``rate * sign(mean load - load)``: an expert
that received more than its share of the batch's assignments becomes less likely to be chosen next
step, and one that received less becomes more likely. The biases are array leaves of the model (so
they are saved, restored and sharded with it) that the optimizer never updates (their
declared role, ``Role.ROUTER_BIAS``, is not trained).
"""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from eqmoe.model import Transformer
from eqmoe.nn.moe import MoE


def bias_step(counts: Float[Array, "*layers experts"], rate: float) -> Float[Array, "*layers experts"]:
    """``rate * sign(mean load - load)`` per layer, from the assignment counts of each expert."""
    return rate * jnp.sign(jnp.mean(counts, axis=-1, keepdims=True) - counts)


def update_router_biases(model: Transformer, expert_counts: Float[Array, "moe_layers experts"]) -> Transformer:
    """``model`` with each biased router moved by :func:`bias_step` of its layer's ``expert_counts``
    (rows in layer order, as ``ModelOutput.aux`` gives them). Models without biases come back unchanged."""
    moe = model.config.moe
    if moe is None or moe.router.bias_update_rate == 0:
        return model
    layers = sum(isinstance(block.ffn, MoE) * unit.repeats for unit in model.segments for block in unit.blocks)
    if expert_counts.shape[0] != layers:
        raise ValueError(f"expert_counts has {expert_counts.shape[0]} rows for a model with {layers} MoE layers")
    segments, row = list(model.segments), 0
    for s, segment in enumerate(segments):
        positions = [i for i, block in enumerate(segment.blocks) if isinstance(block.ffn, MoE)]
        if not positions:
            continue
        # This segment's rows are layer-ordered: repeat r, then the unit's MoE blocks in order.
        rows = expert_counts[row : row + segment.repeats * len(positions)]
        rows = rows.reshape(segment.repeats, len(positions), -1)
        row += segment.repeats * len(positions)
        blocks = list(segment.blocks)
        for j, position in enumerate(positions):
            router = blocks[position].ffn.router
            new_bias = router.bias + bias_step(rows[:, j], moe.router.bias_update_rate).astype(router.bias.dtype)
            blocks[position] = eqx.tree_at(lambda b: b.ffn.router.bias, blocks[position], new_bias)
        segments[s] = eqx.tree_at(lambda u: u.blocks, segment, tuple(blocks))
    return eqx.tree_at(lambda m: m.segments, model, tuple(segments))
