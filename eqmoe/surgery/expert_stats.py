"""Per-expert statistics of a MoE model on calibration tokens, the inputs of expert pruning and merging.

The model runs one layer at a time (its stacked segments sliced layer by layer), so besides the model only one
layer's parameters, the batch's hidden states and one expert's outputs are held at once. At each routed layer the
layer's own input (its FFN input, after the norm) goes through the router and through every routed expert, in
float32, and four sums are kept per expert ``j`` over the calibration tokens ``x``:

- ``counts[j] = |X_j|``, the tokens routed to ``j`` (``j`` among their ``top_k``, kept by capacity);
- ``gate_sums[j] = sum_{x in X_j} g_j(x)``, with ``g_j(x)`` the combine weight the model gives ``j`` on ``x`` (after
  the family's softmax or sigmoid, top-k renormalisation and scaling factor, as the layer applies it);
- ``reap_sums[j] = sum_{x in X_j} g_j(x) ||f_j(x)||_2``, with ``f_j(x)`` the expert's output;
- ``norm_sums[j] = sum_{x in X_j} ||f_j(x)||_2``;
- ``output_sums[j] = sum_x f_j(x)`` over all tokens (the expert's mean output, HC-SMoE's representation of an expert,
  which the merge compares experts by).

The scores the criteria read (:meth:`ExpertStats.scores`):

- ``reap``: ``reap_sums / counts`` (REAP, Lasby et al. 2025, eq. for the saliency ``S_j``; 0 for an expert no token
  reached);
- ``frequency``: ``counts / tokens``, the share of calibration tokens routed to the expert;
- ``router-weight``: ``gate_sums / tokens``, the gate value summed over the tokens routed to it, per calibration
  token (the soft count of the frequency baseline);
- ``ean``: ``norm_sums / tokens``, the expert activation norm summed over the tokens routed to it (EAN, the pruning
  baseline REAP compares against besides frequency), per calibration token.
"""

from collections.abc import Iterable
from typing import Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from eqmoe.model import Transformer
from eqmoe.models.family import layer_slots
from eqmoe.nn.block import PLACEMENTS, Block
from eqmoe.nn.context import Context
from eqmoe.nn.experts import RoutedExperts
from eqmoe.nn.moe import MoE
from eqmoe.nn.router import Routing

Criterion = Literal["reap", "frequency", "router-weight", "ean"]
CRITERIA: tuple[Criterion, ...] = ("reap", "frequency", "router-weight", "ean")


class ExpertStats(NamedTuple):
    """The sums above for every routed layer, in layer order (``layers``: their model layer numbers)."""

    layers: Int[np.ndarray, " layers"]
    tokens: int
    counts: Float[np.ndarray, "layers experts"]
    gate_sums: Float[np.ndarray, "layers experts"]
    reap_sums: Float[np.ndarray, "layers experts"]
    norm_sums: Float[np.ndarray, "layers experts"]
    output_sums: Float[np.ndarray, "layers experts embed"]

    def scores(self, criterion: Criterion) -> Float[np.ndarray, "layers experts"]:
        """Each expert's score under ``criterion`` (higher: more worth keeping)."""
        if criterion == "reap":
            return np.where(self.counts > 0, self.reap_sums / np.maximum(self.counts, 1), 0.0)
        if criterion == "frequency":
            return self.counts / max(self.tokens, 1)
        if criterion == "router-weight":
            return self.gate_sums / max(self.tokens, 1)
        if criterion == "ean":
            return self.norm_sums / max(self.tokens, 1)
        raise ValueError(f"criterion {criterion!r} is invalid; allowed: {' | '.join(CRITERIA)}")

    def mean_outputs(self) -> Float[np.ndarray, "layers experts embed"]:
        return self.output_sums / max(self.tokens, 1)


class LayerSums(NamedTuple):
    counts: Float[Array, " experts"]
    gate_sums: Float[Array, " experts"]
    reap_sums: Float[Array, " experts"]
    norm_sums: Float[Array, " experts"]
    output_sums: Float[Array, "experts embed"]


def expert_outputs_norms_and_sums(
    experts: RoutedExperts, x: Float[Array, "tokens embed"], real: Bool[Array, " tokens"]
) -> tuple[Float[Array, "experts tokens"], Float[Array, "experts embed"]]:
    """Every expert's output norm on every token, and its outputs summed over the real tokens; one expert's
    outputs at a time (a ``lax.map`` over the stacked experts)."""
    params, static = eqx.partition(experts, eqx.is_array)

    def one_expert(expert_params):
        fused = eqx.combine(expert_params, static).fused()
        y = fused.output(fused.pre_activations(x)).astype(jnp.float32)
        return jnp.linalg.norm(y, axis=-1), jnp.where(real[:, None], y, 0.0).sum(axis=0)

    return jax.lax.map(one_expert, params)


def moe_layer_sums(
    moe: MoE, h: Float[Array, "batch seq embed"], routing: Routing, token_mask: Bool[Array, "batch seq"]
) -> LayerSums:
    """The four sums of one routed layer over the real tokens of ``h``, its FFN input, routed by ``routing``."""
    flat, real = h.reshape(-1, h.shape[-1]).astype(jnp.float32), token_mask.reshape(-1)
    num_experts = routing.logits.shape[-1]
    chosen = jax.nn.one_hot(routing.experts, num_experts, dtype=jnp.float32) * routing.kept[..., None]  # [T, k, E]
    routed = chosen.sum(axis=1)  # [T, E]: 1 where the expert is among the token's kept top-k
    gates = jnp.einsum("tk,tke->te", routing.weights.astype(jnp.float32), chosen)
    norms, output_sums = expert_outputs_norms_and_sums(moe.experts, flat, real)
    reap_sums, norm_sums = (gates * norms.T).sum(axis=0), (routed * norms.T).sum(axis=0)
    return LayerSums(routed.sum(axis=0), gates.sum(axis=0), reap_sums, norm_sums, output_sums)


@eqx.filter_jit
def _run_layer(
    block: Block, x: Float[Array, "batch seq embed"], context: Context
) -> tuple[Float[Array, "batch seq embed"], LayerSums | None]:
    """One decoder layer as :class:`~eqmoe.nn.block.Block` runs it, with the routed layer's sums from the FFN input
    the block computes on the way (which its own call does not return)."""
    attended, _ = block.attention(block.attn_norm(x), context, None, None)
    x = x + attended
    h = block.pre_norm(x) if block.pre_norm is not None else x
    y, routing = block.ffn(h, context)
    sums = moe_layer_sums(block.ffn, h, routing, context.token_mask) if isinstance(block.ffn, MoE) else None
    return PLACEMENTS.get(block.placement).residual(x, y, block.post_norm), sums


def _float32(leaf):
    return leaf.astype(jnp.float32) if eqx.is_inexact_array(leaf) else leaf


def _layer_block(model: Transformer, segment: int, repeat: int, position: int) -> Block:
    """One layer's block, sliced out of its stacked segment, in float32 (a model held in bfloat16 is copied to float32
    one layer at a time)."""
    blocks = model.segments[segment].blocks[position]
    return jax.tree.map(lambda leaf: _float32(leaf[repeat]) if eqx.is_array(leaf) else leaf, blocks)


class Batch(NamedTuple):
    tokens: Int[np.ndarray, "batch seq"]
    segment_ids: Int[np.ndarray, "batch seq"]  # 0 on padding
    positions: Int[np.ndarray, "batch seq"]


def collect_expert_stats(model: Transformer, batches: Iterable[Batch]) -> ExpertStats:
    """:class:`ExpertStats` of ``model`` (run in float32, whatever it is held in) over the real tokens of
    ``batches``."""
    slots = list(layer_slots(model.config))
    routed = [layer for layer, s, r, u, _ in slots if isinstance(model.segments[s].blocks[u].ffn, MoE)]
    if not routed:
        raise ValueError("the model has no routed experts (a dense model): there is nothing to prune")
    num_experts, embed = model.config.moe.router.num_experts, model.config.embed_dim
    counts, gate_sums, reap_sums, norm_sums = (np.zeros((len(routed), num_experts)) for _ in range(4))
    output_sums = np.zeros((len(routed), num_experts, embed))
    tokens = 0
    for batch in batches:
        token_mask = jnp.asarray(batch.segment_ids > 0)
        tokens += int(token_mask.sum())
        context = model._context(
            jnp.asarray(batch.tokens), jnp.asarray(batch.segment_ids), jnp.asarray(batch.positions), token_mask, None
        )
        x = _float32(model.embed[jnp.asarray(batch.tokens)])
        ordinal = 0
        for _, s, r, u, _ in slots:
            x, sums = _run_layer(_layer_block(model, s, r, u), x, context)
            if sums is not None:
                counts[ordinal] += np.asarray(sums.counts)
                gate_sums[ordinal] += np.asarray(sums.gate_sums)
                reap_sums[ordinal] += np.asarray(sums.reap_sums)
                norm_sums[ordinal] += np.asarray(sums.norm_sums)
                output_sums[ordinal] += np.asarray(sums.output_sums)
                ordinal += 1
    return ExpertStats(np.asarray(routed, np.int32), tokens, counts, gate_sums, reap_sums, norm_sums, output_sums)
