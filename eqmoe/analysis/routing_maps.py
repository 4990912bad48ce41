"""The routing analyses MoE papers publish (Switch, GShard, OLMoE, DeepSeek), on the per-token records of
:mod:`eqmoe.analysis.routing_records` (:class:`RoutingRecorder` keeps them; its names are importable from here too).
Everything here is plain NumPy on those records:

- :func:`load_report`: each expert's share of a layer's assignments, its p1/p50/p99 and the dead experts;
- :func:`coactivation`: how often two experts are chosen for the same token;
- :func:`cross_layer_agreement`: how much a token's top-1 expert in one MoE layer predicts its top-1 in the next;
- :func:`vocabulary_specialisation`: the token ids each expert receives most, and how consistently a token id is
  sent to one expert (OLMoE, section 5);
- :func:`domain_routing`: assignments and next-token loss per data domain.

The ``plot_*`` functions draw each analysis on a matplotlib ``Figure`` with the Agg canvas (no pyplot state).
Layers are indexed ``0..L-1`` over the MoE layers; ``RoutingRecords.layers`` maps them to model layer numbers.
"""

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from jaxtyping import Bool, Float, Int

from eqmoe.analysis.routing import normalized_mutual_information
from eqmoe.analysis.routing_records import (  # noqa: F401 (the records' names, importable from here as before)
    RoutingRecorder,
    RoutingRecords,
    TraceFormat,
    collect_routing,
    concat_records,
    moe_layer_numbers,
    trace_columns,
    write_trace,
)

# --- analyses ---------------------------------------------------------------------------------------------------


def _chosen(records: RoutingRecords, layer: int) -> Bool[np.ndarray, "tokens experts"]:
    """``M[t, e]``: whether token ``t`` chose expert ``e`` (any rank) in MoE layer ``layer``."""
    chosen = np.zeros((records.num_tokens, records.num_experts), bool)
    np.put_along_axis(chosen, records.experts[:, layer], True, axis=1)
    return chosen


def expert_counts(records: RoutingRecords) -> Int[np.ndarray, "layers experts"]:
    """``n[l, e]``: the top-k assignments of MoE layer ``l`` that chose expert ``e`` (before capacity drops)."""
    layers = records.experts.shape[1]
    offsets = np.arange(layers)[None, :, None] * records.num_experts
    return np.bincount((records.experts + offsets).ravel(), minlength=layers * records.num_experts).reshape(
        layers, records.num_experts
    )


class LoadReport(NamedTuple):
    share: Float[np.ndarray, "layers experts"]  # n[l, e] / sum_e n[l, e]
    levels: tuple[float, ...]  # the percentiles asked for, e.g. (1, 50, 99)
    percentiles: Float[np.ndarray, "layers levels"]  # of each layer's shares over its experts
    dead: tuple[tuple[int, ...], ...]  # per layer, the experts whose share is under the threshold
    dead_threshold: float  # as a fraction of the uniform share 1/E


def load_report(
    records: RoutingRecords, levels: Sequence[float | int] = (1, 50, 99), dead_threshold: float | int = 1e-3
) -> LoadReport:
    """Expert load per MoE layer: ``share[l, e] = n[l, e] / sum_e' n[l, e']`` of the top-k assignments, its
    percentiles over the experts (``np.percentile``, linear between the sorted shares: rank ``q/100 (E-1)``)
    and the dead experts: those with no assignment or ``share[l, e] < dead_threshold / E``.

    The default threshold, a thousandth of the uniform share, marks experts the router has as good as
    abandoned; below ``1000 E / k`` recorded tokens it only catches experts with no assignment at all, so a
    small sample never calls a rarely chosen expert dead."""
    counts = expert_counts(records)
    share = counts / np.maximum(counts.sum(-1, keepdims=True), 1).astype(np.float64)
    dead_mask = (counts == 0) | (share < dead_threshold / records.num_experts)
    dead = tuple(tuple(int(e) for e in np.flatnonzero(row)) for row in dead_mask)
    percentiles = np.percentile(share, list(levels), axis=-1).T
    return LoadReport(share, tuple(float(q) for q in levels), percentiles, dead, float(dead_threshold))


class CoActivation(NamedTuple):
    matrix: Float[np.ndarray, "layers experts experts"]  # C[l, i, j]: fraction of tokens choosing both i and j
    conditional: Float[np.ndarray, "layers experts experts"]  # C[l, i, j] / C[l, i, i]: P(j chosen | i chosen)
    top_pairs: tuple[tuple[tuple[int, int, float], ...], ...]  # per layer, (i, j, C[i, j]) with i < j, largest first


def coactivation(records: RoutingRecords, pairs: int = 5) -> CoActivation:
    """Expert co-activation per MoE layer: ``C[i, j] = (1/N) #{t : i in S_t and j in S_t}`` with ``S_t`` the
    token's top-k set (so ``C[i, i]`` is the fraction of tokens choosing ``i``), and OLMoE's conditional form
    ``C[i, j] / C[i, i]``. ``top_pairs`` are the ``pairs`` most frequent pairs ``i < j`` that occur at all (none
    with top-1 routing)."""
    layers, num_experts = records.experts.shape[1], records.num_experts
    matrix = np.zeros((layers, num_experts, num_experts))
    for layer in range(layers):
        chosen = _chosen(records, layer).astype(np.float64)
        matrix[layer] = chosen.T @ chosen / max(records.num_tokens, 1)
    diagonal = np.diagonal(matrix, axis1=1, axis2=2)[:, :, None]
    conditional = np.where(diagonal > 0, matrix / np.where(diagonal > 0, diagonal, 1.0), 0.0)
    upper_i, upper_j = np.triu_indices(num_experts, k=1)
    top = []
    for layer in range(layers):
        values = matrix[layer, upper_i, upper_j]
        order = [index for index in np.argsort(-values, kind="stable")[:pairs] if values[index] > 0]
        top.append(tuple((int(upper_i[i]), int(upper_j[i]), float(values[i])) for i in order))
    return CoActivation(matrix, conditional, tuple(top))


class LayerAgreement(NamedTuple):
    """One row per consecutive pair of MoE layers ``(l, l + 1)``."""

    joint: Int[np.ndarray, "pairs experts experts"]  # T[i, j]: tokens with top-1 i in layer l and j in l + 1
    conditional: Float[np.ndarray, "pairs experts experts"]  # P(j | i) = T[i, j] / sum_j T[i, j] (0 for unseen i)
    nmi: Float[np.ndarray, " pairs"]  # 2 I(e_l; e_l+1) / (H(e_l) + H(e_l+1))
    accuracy: Float[np.ndarray, " pairs"]  # sum_i P(i) max_j P(j | i) = sum_i max_j T[i, j] / N
    baseline: Float[np.ndarray, " pairs"]  # max_j P(j): the same guess for every token, ignoring layer l


def cross_layer_agreement(records: RoutingRecords) -> LayerAgreement:
    """How much a token's top-1 expert in MoE layer ``l`` tells about its top-1 in layer ``l + 1``: the
    conditional table ``P(e_{l+1} = j | e_l = i)``, the normalised mutual information of the joint counts
    (:func:`~eqmoe.analysis.routing.normalized_mutual_information`) and the top-1 prediction accuracy
    ``sum_i P(i) max_j P(j | i)``: how often the most likely next expert given this one is right (1 when the
    next layer's choice is a function of this one's). ``baseline`` is that accuracy without layer ``l``."""
    layers, num_experts = records.experts.shape[1], records.num_experts
    top1 = records.experts[:, :, 0]
    pairs = max(layers - 1, 0)
    joint = np.zeros((pairs, num_experts, num_experts), np.int64)
    for pair in range(pairs):
        joint[pair] = np.bincount(
            top1[:, pair] * num_experts + top1[:, pair + 1], minlength=num_experts * num_experts
        ).reshape(num_experts, num_experts)
    rows = joint.sum(-1, keepdims=True)
    conditional = np.where(rows > 0, joint / np.maximum(rows, 1), 0.0)
    total = max(records.num_tokens, 1)
    return LayerAgreement(
        joint=joint,
        conditional=conditional,
        nmi=np.asarray([normalized_mutual_information(table) for table in joint], np.float64),
        accuracy=joint.max(-1).sum(-1) / total,
        baseline=joint.sum(-2).max(-1) / total,
    )


class VocabularySpecialisation(NamedTuple):
    top_tokens: Int[np.ndarray, "layers experts n"]  # each expert's most frequent token ids (-1 past the end)
    top_counts: Int[np.ndarray, "layers experts n"]  # how many of the expert's assignments each of them is
    top_share: Float[np.ndarray, "layers experts"]  # share of the expert's assignments going to those ids (NaN: unused)
    token_ids: Int[np.ndarray, " vocab"]  # every recorded token id, ascending
    token_counts: Int[np.ndarray, " vocab"]  # its occurrences
    token_expert: Int[np.ndarray, "layers vocab"]  # the expert its occurrences choose most (lowest id on a tie)
    token_fraction: Float[np.ndarray, "layers vocab"]  # fraction of its occurrences that chose that expert
    specialisation: Float[np.ndarray, " layers"]  # occurrence-weighted mean of token_fraction (k/E: none)


def vocabulary_specialisation(records: RoutingRecords, top_n: int = 10) -> VocabularySpecialisation:
    """OLMoE's vocabulary specialisation from ``A[l, v, e]``, the top-k assignments of token id ``v`` to expert
    ``e`` in MoE layer ``l``:

    - per expert, the ``top_n`` ids with the largest ``A[l, v, e]`` and ``top_share = sum_{v in top} A[l, v, e]
      / sum_v A[l, v, e]``;
    - per token id, ``token_fraction = max_e A[l, v, e] / occurrences(v)``: the fraction of its occurrences
      routed (at any of the k ranks) to its most frequent expert (1: always the same expert; about k/E: no
      preference), and ``specialisation[l] = sum_v max_e A[l, v, e] / N``, its occurrence-weighted mean.
    """
    layers, num_experts = records.experts.shape[1], records.num_experts
    token_ids, token_index, token_counts = np.unique(records.token_ids, return_inverse=True, return_counts=True)
    vocab = len(token_ids)
    top_n = min(top_n, vocab)
    top_tokens = np.full((layers, num_experts, top_n), -1, np.int64)
    top_counts = np.zeros((layers, num_experts, top_n), np.int64)
    top_share = np.full((layers, num_experts), np.nan)
    token_expert = np.zeros((layers, vocab), np.int64)
    token_fraction = np.zeros((layers, vocab))
    for layer in range(layers):
        keys = token_index[:, None] * num_experts + records.experts[:, layer]
        table = np.bincount(keys.ravel(), minlength=vocab * num_experts).reshape(vocab, num_experts)
        order = np.argsort(-table, axis=0, kind="stable")[:top_n].T  # [experts, n]: ids by count, ties by id
        counts = np.take_along_axis(table.T, order, axis=1)
        top_tokens[layer] = np.where(counts > 0, token_ids[order], -1)
        top_counts[layer] = counts
        totals = table.sum(0)
        top_share[layer] = np.where(totals > 0, counts.sum(1) / np.maximum(totals, 1), np.nan)
        token_expert[layer] = table.argmax(1)
        token_fraction[layer] = table.max(1) / token_counts
    specialisation = (token_fraction * token_counts).sum(-1) / max(records.num_tokens, 1)
    return VocabularySpecialisation(
        top_tokens, top_counts, top_share, token_ids, token_counts, token_expert, token_fraction, specialisation
    )


class DomainRouting(NamedTuple):
    counts: Int[np.ndarray, "layers domains experts"]  # top-k assignments of each domain's tokens to each expert
    nmi: Float[np.ndarray, " layers"]  # normalised domain-expert mutual information of those counts
    tokens: Int[np.ndarray, " domains"]  # recorded tokens of each domain
    loss: Float[np.ndarray, " domains"]  # mean next-token loss of its predicted tokens (NaN: none)


def domain_routing(records: RoutingRecords, num_domains: int | None = None) -> DomainRouting:
    """Routing beside loss per data domain: ``counts[l, d, e] = #{(t, r): domain_t = d, e_{t,l,r} = e}``, its
    NMI per layer (0: the experts ignore the domain, 1: each domain has its own), and the mean next-token loss
    ``mean_{t: domain_t = d} -log p(x_t | x_<t)`` over the tokens that have a loss. Tokens of domain -1 are
    left out."""
    if records.domains is None:
        raise ValueError("the records carry no domains (record them with domains=...)")
    domains = records.domains
    count = int(domains.max(initial=-1)) + 1 if num_domains is None else num_domains
    labelled = domains >= 0
    layers, num_experts = records.experts.shape[1], records.num_experts
    counts = np.zeros((layers, count, num_experts), np.int64)
    for layer in range(layers):
        keys = domains[labelled, None] * num_experts + records.experts[labelled, layer]
        counts[layer] = np.bincount(keys.ravel(), minlength=count * num_experts).reshape(count, num_experts)
    losses = records.losses if records.losses is not None else np.full(records.num_tokens, np.nan)
    scored = labelled & np.isfinite(losses)
    loss_sum = np.bincount(domains[scored], weights=losses[scored], minlength=count)
    scored_tokens = np.bincount(domains[scored], minlength=count)
    with np.errstate(invalid="ignore", divide="ignore"):
        loss = np.where(scored_tokens > 0, loss_sum / scored_tokens, np.nan)
    return DomainRouting(
        counts=counts,
        nmi=np.asarray([normalized_mutual_information(table) for table in counts], np.float64),
        tokens=np.bincount(domains[labelled], minlength=count),
        loss=loss,
    )


# --- plots ------------------------------------------------------------------------------------------------------


def _figure(**options):
    """A matplotlib ``Figure`` on the Agg canvas, not registered with pyplot (nothing to close)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(**options)
    FigureCanvasAgg(figure)
    return figure


def _grid(figure, count: int):
    columns = math.ceil(math.sqrt(count))
    axes = figure.subplots(math.ceil(count / columns), columns, squeeze=False).ravel()
    for axis in axes[count:]:
        axis.set_visible(False)
    return axes[:count]


def plot_load(report: LoadReport, layers: Sequence[int] | None = None):
    """Each MoE layer's expert-share percentiles against the uniform share ``1/E``, dead experts in the labels."""
    count, num_experts = report.share.shape
    names = list(range(count)) if layers is None else list(layers)
    figure = _figure(figsize=(max(5.0, 0.5 * count + 2), 3.6))
    axis = figure.subplots()
    for level, values in zip(report.levels, report.percentiles.T, strict=True):
        axis.plot(range(count), values, marker="o", label=f"p{level:g}")
    axis.axhline(1 / num_experts, color="grey", linestyle="--", label="uniform 1/E")
    labels = [f"{name}\n({len(dead)} dead)" for name, dead in zip(names, report.dead, strict=True)]
    axis.set_xticks(range(count), labels)
    axis.set_xlabel("MoE layer")
    axis.set_ylabel("share of assignments")
    axis.set_title("expert load percentiles per layer", fontsize=10)
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


def plot_coactivation(result: CoActivation, layers: Sequence[int] | None = None):
    """A heatmap of ``C[i, j]`` per MoE layer, the diagonal (each expert's own frequency) left blank."""
    count = result.matrix.shape[0]
    names = list(range(count)) if layers is None else list(layers)
    columns = math.ceil(math.sqrt(count))
    figure = _figure(figsize=(3.2 * columns, 3.0 * math.ceil(count / columns)))
    off_diagonal = result.matrix.copy()
    off_diagonal[:, np.arange(off_diagonal.shape[1]), np.arange(off_diagonal.shape[1])] = np.nan
    top = np.nanmax(off_diagonal) if np.isfinite(off_diagonal).any() else 1.0
    image = None
    for layer, axis in enumerate(_grid(figure, count)):
        image = axis.imshow(off_diagonal[layer], vmin=0, vmax=top or 1.0, cmap="viridis")
        axis.set_title(f"layer {names[layer]}", fontsize=9)
        axis.set_xlabel("expert j", fontsize=8)
        axis.set_ylabel("expert i", fontsize=8)
    figure.colorbar(image, ax=figure.axes, shrink=0.8, label="fraction of tokens choosing i and j")
    return figure


def plot_agreement(result: LayerAgreement, layers: Sequence[int] | None = None):
    """Per consecutive pair of MoE layers: top-1 prediction accuracy, its no-information baseline and the NMI."""
    count = len(result.nmi)
    names = list(range(count + 1)) if layers is None else list(layers)
    figure = _figure(figsize=(max(5.0, 0.8 * count + 2), 3.6))
    axis = figure.subplots()
    x, width = np.arange(count), 0.27
    axis.bar(x - width, result.accuracy, width, label="top-1 accuracy  sum_i P(i) max_j P(j|i)")
    axis.bar(x, result.baseline, width, label="baseline  max_j P(j)")
    axis.bar(x + width, result.nmi, width, label="NMI")
    axis.set_xticks(x, [f"{names[i]}->{names[i + 1]}" for i in range(count)])
    axis.set_ylim(0, 1.05)
    axis.set_xlabel("MoE layer pair")
    axis.set_title("cross-layer routing agreement (top-1 expert)", fontsize=10)
    axis.legend(fontsize=7)
    figure.tight_layout()
    return figure


def plot_vocabulary(result: VocabularySpecialisation, layers: Sequence[int] | None = None):
    """Per MoE layer, bars of each expert's share of assignments to its top-N token ids, titled with the
    occurrence-weighted token specialisation."""
    count, num_experts = result.top_share.shape
    names = list(range(count)) if layers is None else list(layers)
    columns = math.ceil(math.sqrt(count))
    figure = _figure(figsize=(3.4 * columns, 2.6 * math.ceil(count / columns)))
    top_n = result.top_tokens.shape[-1]
    for layer, axis in enumerate(_grid(figure, count)):
        axis.bar(range(num_experts), np.nan_to_num(result.top_share[layer]))
        axis.set_ylim(0, 1.0)
        axis.set_title(f"layer {names[layer]}: token spec. {result.specialisation[layer]:.2f}", fontsize=9)
        axis.set_xlabel("expert", fontsize=8)
        axis.set_ylabel(f"share to top-{top_n} ids", fontsize=8)
    figure.tight_layout()
    return figure
