"""Routing statistics, computed from the routings the MoE layers return (never threaded through the layers),
and the load-balance losses built on them.

A model call returns each MoE layer's :class:`~eqmoe.nn.router.Routing`, stacked in layer order
(``ModelOutput.routing``); :func:`layer_stats` reduces it to one :class:`RouterStats` per layer over the real
tokens, per packed document and per data domain where those are given. The load-balance forms are registered in
:data:`eqmoe.registries.LOAD_BALANCE` (name -> function of the stacked statistics giving the scalar);
``LossConfig.load_balance`` names the trained one and every registered form is reported.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from eqmoe.nn.router import Routing, _groups
from eqmoe.registries import LOAD_BALANCE


class RouterStats(NamedTuple):
    """Per-MoE-layer routing statistics over the real (unmasked) tokens.

    Sums are kept (not only means) so that losses pooled over layers, such as HF's load-balancing
    loss, can be formed exactly. Every load-balancing form is computed; the config picks the trained one.
    Means over groups or documents count only those holding a real token, so padding changes nothing.
    """

    expert_counts: Float[Array, "*layers experts"]  # top-k assignments choosing each expert, before drops
    prob_sum: Float[Array, "*layers experts"]  # sum of router probabilities per expert
    num_tokens: Float[Array, "*layers"]
    dropped: Float[Array, "*layers"]  # assignments dropped by capacity
    top1_balance: Float[Array, "*layers"]  # AXLearn: E^2 * mean_{groups, e}(top-1 fraction * P)
    sequence_balance: Float[Array, "*layers"]  # MaxText per packed document: E^2 * mean_{documents, e}(density * P)
    z_loss: Float[Array, "*layers"]  # mean logsumexp(logits)^2
    entropy_sum: Float[Array, "*layers"]  # sum over tokens of the router distribution's entropy (nats)
    domain_counts: Float[Array, "*layers domains experts"] | None = None  # assignments per token domain
    # expert_counts, prob_sum and num_tokens per micro-batch of consecutive rows (LossConfig.balance_micro_batch_rows)
    micro_batch_counts: Float[Array, "*layers micro experts"] | None = None
    micro_batch_prob_sum: Float[Array, "*layers micro experts"] | None = None
    micro_batch_tokens: Float[Array, "*layers micro"] | None = None

    @property
    def load(self) -> Float[Array, "*layers experts"]:
        """Fraction of the routed assignments each expert received (sums to 1 per layer)."""
        return self.expert_counts / jnp.maximum(self.expert_counts.sum(-1, keepdims=True), 1.0)

    @property
    def entropy(self) -> Float[Array, "*layers"]:
        """Mean per-token entropy of the router probabilities, in nats (``log E`` = uniform)."""
        return self.entropy_sum / jnp.maximum(self.num_tokens, 1.0)

    @property
    def dropped_fraction(self) -> Float[Array, "*layers"]:
        return self.dropped / jnp.maximum(self.expert_counts.sum(-1), 1.0)

    @property
    def max_vio(self) -> Float[Array, "*layers"]:
        """MaxVio (:func:`max_violation`) of each layer's assignments."""
        return max_violation(self.expert_counts)


def max_violation(expert_counts: Float[Array, "*layers experts"]) -> Float[Array, "*layers"]:
    """MaxVio (Wang et al. 2024, auxiliary-loss-free balancing): ``max_e load_e / mean_e load_e - 1`` of the
    top-k assignment counts before capacity drops; 0 when balanced (and for a layer that routed nothing),
    ``E - 1`` when one expert takes every assignment. Not additive: take it of summed counts, never average it."""
    mean = jnp.mean(expert_counts, axis=-1)
    return jnp.where(mean > 0, jnp.max(expert_counts, axis=-1) / jnp.where(mean > 0, mean, 1.0) - 1.0, 0.0)


def _balance(
    fractions: Float[Array, "items experts"], probs: Float[Array, "items experts"], counts: Float[Array, " items"]
) -> Float[Array, ""]:
    """``E^2 * mean_{items, e}(fraction * P)`` from per-item sums, over the items with a real token only
    (an all-padding group or document would otherwise pull the mean toward 0)."""
    num_experts = fractions.shape[-1]
    per_item = jnp.sum(fractions * probs, axis=-1) / jnp.square(jnp.maximum(counts, 1.0))
    return num_experts * jnp.sum(per_item) / jnp.maximum(jnp.sum(counts > 0), 1)


def router_stats(
    routing: Routing,
    token_mask: Bool[Array, "batch seq"],
    num_groups: int,
    token_domains: Float[Array, "batch seq domains"] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    balance_micro_batch_rows: int = 1,
) -> RouterStats:
    """Statistics of one layer's routing over the tokens where ``token_mask`` is true.

    ``sequence_balance`` is taken per packed document: the tokens of one row with one segment id
    (ids in ``0..seq``, as :mod:`eqmoe.data.packing` makes them); without ``segment_ids`` each row is
    one document. With ``token_domains`` (a one-hot domain label per token) ``domain_counts[d, e]``
    counts the top-k assignments of domain ``d``'s tokens to expert ``e`` (before capacity drops).
    The ``micro_batch_*`` sums are per slice of ``balance_micro_batch_rows`` consecutive rows; when those do not
    divide the batch, the last slice holds the remaining rows.
    """
    probs = routing.probs
    batch, seq = token_mask.shape
    num_experts = probs.shape[-1]
    valid = token_mask.reshape(-1).astype(jnp.float32)
    chosen = jax.nn.one_hot(routing.experts, num_experts, dtype=jnp.float32)  # [tokens, k, experts]
    expert_counts = jnp.einsum("tke,t->e", chosen, valid)
    prob_sum = jnp.einsum("te,t->e", probs, valid)
    num_tokens = valid.sum()
    rows = jnp.maximum(num_tokens, 1.0)

    groups = _groups(batch * seq, num_groups)
    group_valid = valid.reshape(groups, -1, 1)
    top1_balance = _balance(
        jnp.sum(chosen[:, 0].reshape(groups, -1, num_experts) * group_valid, axis=1),
        jnp.sum(probs.reshape(groups, -1, num_experts) * group_valid, axis=1),
        group_valid.sum(axis=(1, 2)),
    )

    # Sums per (row, segment id) with one scatter per row: vmap keeps the rows a batch dimension of the
    # scatter, so it stays split over a mesh's batch axes and nothing is [batch, seq, seq].
    documents = jnp.ones((batch, seq), jnp.int32) if segment_ids is None else segment_ids
    per_token = jnp.concatenate([chosen.sum(axis=1), probs, jnp.ones_like(valid)[:, None]], axis=-1)
    per_token = (per_token * valid[:, None]).reshape(batch, seq, -1)
    sums = jax.vmap(lambda values, ids: jax.ops.segment_sum(values, ids, num_segments=seq + 1))(per_token, documents)
    sums = sums.reshape(batch * (seq + 1), -1)
    sequence_balance = _balance(sums[:, :num_experts], sums[:, num_experts:-1], sums[:, -1])

    slices = -(-batch // balance_micro_batch_rows)
    row_sums = per_token.sum(axis=1)
    micro = jax.ops.segment_sum(row_sums, jnp.arange(batch) // balance_micro_batch_rows, num_segments=slices)

    dropped = jnp.sum((~routing.kept) * valid[:, None])
    z_loss = jnp.sum(jnp.square(jax.nn.logsumexp(routing.logits, axis=-1)) * valid) / rows
    log_probs = jax.nn.log_softmax(routing.logits, axis=-1)
    entropy_sum = jnp.sum(-jnp.sum(probs * log_probs, axis=-1) * valid)
    domain_counts = None
    if token_domains is not None:
        domains = token_domains.reshape(batch * seq, -1).astype(jnp.float32) * valid[:, None]
        domain_counts = jnp.einsum("td,tke->de", domains, chosen)
    return RouterStats(
        expert_counts,
        prob_sum,
        num_tokens,
        dropped,
        top1_balance,
        sequence_balance,
        z_loss,
        entropy_sum,
        domain_counts,
        micro[:, :num_experts],
        micro[:, num_experts:-1],
        micro[:, -1],
    )


def layer_stats(
    routing: Routing,
    token_mask: Bool[Array, "batch seq"],
    num_groups: int = 1,
    token_domains: Float[Array, "batch seq domains"] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    balance_micro_batch_rows: int = 1,
) -> RouterStats:
    """:func:`router_stats` of every layer of a stacked routing (``ModelOutput.routing``), in layer order."""
    return jax.vmap(
        lambda one: router_stats(one, token_mask, num_groups, token_domains, segment_ids, balance_micro_batch_rows)
    )(routing)


def pooled_load_balance(aux: RouterStats) -> Float[Array, ""]:
    """HF ``load_balancing_loss_func``: ``E * sum_e f_e * P_e`` with ``f_e`` (top-k assignments per token
    choosing ``e``) and ``P_e`` (mean probability) pooled over all MoE layers and all real tokens."""
    num_experts = aux.expert_counts.shape[-1]
    rows = jnp.maximum(aux.num_tokens.sum(), 1.0)
    return num_experts * jnp.sum((aux.expert_counts.sum(0) / rows) * (aux.prob_sum.sum(0) / rows))


def micro_batch_load_balance(aux: RouterStats) -> Float[Array, ""]:
    """:func:`pooled_load_balance` (pooled over layers) taken on each micro-batch of consecutive rows
    (``LossConfig.balance_micro_batch_rows``) alone, averaged over the micro-batches holding a real token: the
    micro-batch balance Qiu et al. 2025 compare with the global-batch one (``hf_pooled``)."""
    return _balance(aux.micro_batch_counts.sum(0), aux.micro_batch_prob_sum.sum(0), aux.micro_batch_tokens.sum(0))


LoadBalance = Callable[[RouterStats], Float[Array, ""]]
LOAD_BALANCE.register("hf_pooled", pooled_load_balance)
LOAD_BALANCE.register("axlearn_top1", lambda aux: jnp.mean(aux.top1_balance))  # per layer, averaged
# MaxText's per-sequence form, taken per packed document (RouterStats.sequence_balance), per layer, averaged.
LOAD_BALANCE.register("maxtext_sequence", lambda aux: jnp.mean(aux.sequence_balance))
LOAD_BALANCE.register("micro_batch", micro_batch_load_balance)
