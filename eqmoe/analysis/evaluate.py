"""Held-out evaluation, the library's: every held-out row once, token-weighted, for chat fine-tuning (loss and
exact match of whole answers) and for pretraining (loss and the routing statistics per MoE layer and domain)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eqmoe import parallel
from eqmoe.analysis.routing import accumulate, summarize
from eqmoe.data.packing import PackedRows
from eqmoe.model import Transformer
from eqmoe.train.logging import new_figure, save_figure
from eqmoe.train.step import eval_step, held_out_batches, routing_eval_step


def chat_metrics(model: Transformer, rows: PackedRows, batch_size: int) -> dict[str, float]:
    """Token-weighted eval loss and exact match over every held-out row (padded to whole batches)."""
    totals: dict[str, float] = {}
    for batch, _, _ in held_out_batches(rows, batch_size):
        terms = {k: float(v) for k, v in parallel.to_host(eval_step(model, batch)).items()}
        weight = terms["target_tokens"]
        for name in ("loss", "cross_entropy"):
            totals[name] = totals.get(name, 0.0) + terms[name] * weight
        for name in ("target_tokens", "exact_match_correct", "exact_match_documents"):
            totals[name] = totals.get(name, 0.0) + terms[name]
    tokens = max(totals["target_tokens"], 1.0)
    return {
        "eval_loss": totals["loss"] / tokens,
        "eval_cross_entropy": totals["cross_entropy"] / tokens,
        "eval_accuracy": totals["exact_match_correct"] / max(totals["exact_match_documents"], 1.0),
    }


def routing_metrics(
    model: Transformer, rows: PackedRows, labels: np.ndarray, num_domains: int, batch_size: int
) -> dict:
    """Token-weighted eval loss over every held-out row, and the routing statistics per MoE layer (with each
    token's domain ``labels``, -1 for none: expert-domain mutual information)."""
    loss_sum, tokens, stats = 0.0, 0.0, None
    for batch, index, real in held_out_batches(rows, batch_size):
        domains = jax.nn.one_hot(np.where(real[:, None], labels[index], -1), num_domains, dtype=jnp.float32)
        domains = parallel.replicated_batch(np.asarray(domains), parallel.current(), ("batch", "seq", None))
        terms, aux = parallel.to_host(routing_eval_step(model, batch, domains))
        loss_sum += float(terms["cross_entropy"]) * float(terms["target_tokens"])
        tokens += float(terms["target_tokens"])
        if aux is not None:
            stats = accumulate(stats, aux)
    record = {"eval_loss": loss_sum / max(tokens, 1.0)}
    if stats is not None:
        summary = summarize(stats)
        record.update(
            eval_load_cv=float(summary.load_cv.mean()),
            eval_max_vio=float(summary.max_vio.mean()),
            eval_max_min_ratio=float(summary.max_min_ratio.mean()),
            eval_dropped_fraction=float(summary.dropped_fraction.mean()),
            eval_router_entropy=float(summary.entropy.mean()),
            eval_domain_nmi=float(summary.domain_nmi.mean()),
            layers={
                "load": summary.load.tolist(),
                "load_cv": summary.load_cv.tolist(),
                "max_vio": summary.max_vio.tolist(),
                "max_min_ratio": summary.max_min_ratio.tolist(),
                "dropped_fraction": summary.dropped_fraction.tolist(),
                "router_entropy": summary.entropy.tolist(),
                "domain_nmi": summary.domain_nmi.tolist(),
                "domain_counts": np.asarray(stats.domain_counts).tolist(),
            },
        )
    return record


def plot_domain_routing(domain_counts: np.ndarray, domains: tuple[str, ...], path: Path, nmi: list[float]) -> None:
    """``routing.png``: per MoE layer, the share of each domain's assignments that went to each expert."""
    layers = domain_counts.shape[0]
    figure = new_figure(figsize=(3.2 * layers, 0.5 * len(domains) + 1.6))
    axes = figure.subplots(1, layers, squeeze=False)
    shares = domain_counts / np.maximum(domain_counts.sum(-1, keepdims=True), 1.0)
    for layer, axis in enumerate(axes[0]):
        axis.imshow(shares[layer], vmin=0, vmax=1, cmap="viridis", aspect="auto")
        axis.set_title(f"MoE layer {layer}  NMI {nmi[layer]:.2f}", fontsize=9)
        axis.set_xlabel("expert")
        axis.set_yticks(range(len(domains)), domains if layer == 0 else [""] * len(domains))
    figure.tight_layout()
    save_figure(figure, path)
