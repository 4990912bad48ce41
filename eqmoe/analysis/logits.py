"""Comparing two models' logits on the same tokens: KL divergence and top-k agreement.

The MaxText logit checker's diagnostics: at the last position, the top-k ids of the two models, their
overlap ``|A & B|``, Jaccard ``|A & B| / |A | B|`` and rank agreement (share of the k ranks holding the
same id); and per position ``KL(P_ref || Q)`` over the full vocabulary. Near-ties can flip ranks while
KL stays ~0, so KL is the assertion and the rest are diagnostics. Computed in float64 with NumPy.
"""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LogitComparison:
    kl_mean: float
    kl_max: float
    top_k_overlap: int
    jaccard: float
    rank_agreement: float
    max_abs_difference: float


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def compare_logits(reference: np.ndarray, candidate: np.ndarray, top_k: int = 10) -> LogitComparison:
    """Compare ``[positions, vocab]`` logits of a reference model and a candidate on one prompt."""
    if reference.shape != candidate.shape or reference.ndim != 2:
        raise ValueError(f"logits must both be [positions, vocab]; got {reference.shape} and {candidate.shape}")
    log_p = _log_softmax(np.asarray(reference, np.float64))
    log_q = _log_softmax(np.asarray(candidate, np.float64))
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
    k = min(top_k, reference.shape[-1])
    top_ref = np.argsort(-reference[-1], kind="stable")[:k]
    top_candidate = np.argsort(-candidate[-1], kind="stable")[:k]
    shared = len(set(top_ref.tolist()) & set(top_candidate.tolist()))
    union = len(set(top_ref.tolist()) | set(top_candidate.tolist()))
    return LogitComparison(
        kl_mean=float(kl.mean()),
        kl_max=float(kl.max()),
        top_k_overlap=shared,
        jaccard=shared / union,
        rank_agreement=float(np.mean(top_ref == top_candidate)),
        max_abs_difference=float(np.abs(np.asarray(reference, np.float64) - candidate).max()),
    )
