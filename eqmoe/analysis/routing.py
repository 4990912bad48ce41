"""Routing statistics a researcher compares across router variants: load balance, drops, entropy and how
much the expert choice says about the data's domain.

Everything here works on :class:`eqmoe.nn.router.RouterStats` (summed over any number of batches with
:func:`accumulate`) or on a joint count table of domains and experts, as plain NumPy. The analyses that need
each token's own choice (co-activation, cross-layer agreement, vocabulary specialisation) are in
:mod:`eqmoe.analysis.routing_maps`, on the records (and router traces) of :mod:`eqmoe.analysis.routing_records`.
"""

from typing import NamedTuple

import jax
import numpy as np

from eqmoe.nn.routing_stats import RouterStats


class RoutingSummary(NamedTuple):
    """Per-MoE-layer figures (arrays of shape ``[layers]``, ``load`` is ``[layers, experts]``)."""

    load: np.ndarray  # fraction of the top-k assignments each expert received (before capacity drops)
    load_cv: np.ndarray  # coefficient of variation of the load over experts (0 = perfectly balanced)
    max_vio: np.ndarray  # MaxVio: most loaded expert's load over the mean load, minus 1 (0 = perfectly balanced)
    max_min_ratio: np.ndarray  # most over least loaded expert (inf when an expert received nothing)
    dropped_fraction: np.ndarray  # assignments dropped by capacity over all assignments
    entropy: np.ndarray  # mean per-token router entropy over log(num_experts) (1 = uniform router)
    domain_nmi: np.ndarray | None = None  # normalised expert-domain mutual information (with domain labels)


# RouterStats fields holding one entry per micro-batch of rows, and the axis of those entries.
_MICRO_BATCH_AXES = {"micro_batch_counts": -2, "micro_batch_prob_sum": -2, "micro_batch_tokens": -1}


def accumulate(total: RouterStats | None, stats: RouterStats) -> RouterStats:
    """``total + stats`` for the summed fields, so a summary can cover many batches. The per-batch loss
    values (``load_balance`` etc.) are summed too; divide by the batch count if you need their mean. The
    per-micro-batch sums are concatenated: the micro-batches of both batches, whatever their row counts."""
    stats = jax.tree.map(np.asarray, stats)
    if total is None:
        return stats
    joined = {
        name: np.concatenate([getattr(total, name), getattr(stats, name)], axis=axis)
        for name, axis in _MICRO_BATCH_AXES.items()
        if getattr(stats, name) is not None
    }
    left_out = dict.fromkeys(joined)
    return jax.tree.map(np.add, total._replace(**left_out), stats._replace(**left_out))._replace(**joined)


def summarize(stats: RouterStats) -> RoutingSummary:
    """The :class:`RoutingSummary` of (accumulated) statistics with a leading layer axis."""
    counts = np.asarray(stats.expert_counts, np.float64)
    num_experts = counts.shape[-1]
    load = counts / np.maximum(counts.sum(-1, keepdims=True), 1.0)
    mean = load.mean(-1)
    least, most = load.min(-1), load.max(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(least > 0, most / np.where(least > 0, least, 1.0), np.inf)
    tokens = np.maximum(np.asarray(stats.num_tokens, np.float64), 1.0)
    domain_nmi = None
    if stats.domain_counts is not None:
        domain_nmi = np.asarray([normalized_mutual_information(table) for table in np.asarray(stats.domain_counts)])
    return RoutingSummary(
        load=load,
        load_cv=load.std(-1) / np.maximum(mean, 1e-12),
        max_vio=max_violation(counts),
        max_min_ratio=ratio,
        dropped_fraction=np.asarray(stats.dropped, np.float64) / np.maximum(counts.sum(-1), 1.0),
        entropy=np.asarray(stats.entropy_sum, np.float64) / tokens / np.log(num_experts)
        if num_experts > 1
        else 0 * tokens,
        domain_nmi=domain_nmi,
    )


def max_violation(expert_counts: np.ndarray) -> np.ndarray:
    """MaxVio per layer of ``[..., experts]`` assignment counts: ``max_e n_e / mean_e n_e - 1`` (0 when balanced and
    for a layer with no assignment); :func:`eqmoe.nn.routing_stats.max_violation` in NumPy."""
    counts = np.asarray(expert_counts, np.float64)
    mean = counts.mean(-1)
    return np.where(mean > 0, counts.max(-1) / np.where(mean > 0, mean, 1.0) - 1.0, 0.0)


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def normalized_mutual_information(joint_counts: np.ndarray) -> float:
    """``2 I(D; E) / (H(D) + H(E))`` of a ``[domains, experts]`` table of assignment counts: 0 when the
    expert choice is independent of the domain, 1 when each domain has its own experts (and vice versa)."""
    joint = np.asarray(joint_counts, np.float64)
    if joint.ndim != 2 or (joint < 0).any():
        raise ValueError(f"joint_counts must be a non-negative [domains, experts] table, got shape {joint.shape}")
    total = joint.sum()
    if total == 0:
        return 0.0
    joint = joint / total
    h_domain, h_expert = _entropy(joint.sum(1)), _entropy(joint.sum(0))
    mutual = h_domain + h_expert - _entropy(joint.ravel())
    return 0.0 if h_domain + h_expert == 0 else max(0.0, 2 * mutual / (h_domain + h_expert))
