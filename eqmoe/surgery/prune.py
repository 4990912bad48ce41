"""Expert pruning and merging: a MoE model cut to ``keep`` routed experts per layer, chosen by a criterion's scores
(:class:`~eqmoe.surgery.expert_stats.ExpertStats`).

Pruning keeps, in every routed layer, the ``keep`` experts with the highest scores (the same count in every layer, so
the family's config stays uniform) in their original order, and slices the router's gate columns, its gate bias and
its selection bias (DeepSeek-V3's ``e_score_correction_bias``) and the stacked expert matrices to them. Shared experts,
attention and everything else are untouched. Under group-limited routing (DeepSeek-V3's ``n_group``) each group keeps
``keep / groups`` experts, so the groups stay the same contiguous groups of the same experts.

Merging (``merge=True``) folds each removed expert into the kept expert whose mean output over the calibration tokens
is nearest by cosine similarity (HC-SMoE's expert representation; within its group under group-limited routing). A
kept expert's new matrices (gate, up, down and their biases) are the average of its own and those folded into it,
weighted by how many calibration tokens each was routed to (the frequency-weighted average of M-SMoE and HC-SMoE; an
expert group no token reached is averaged evenly). Its router column stays its own: the router keeps choosing among
the kept experts as it did.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float, Int

from eqmoe.config import ModelConfig
from eqmoe.model import Transformer
from eqmoe.models.family import layer_slots
from eqmoe.registries import FFN_KINDS
from eqmoe.surgery.expert_stats import ExpertStats

# Routers whose choice depends on the experts only through the scores of those present: cutting columns out of the
# gate leaves the kept experts' scores (sigmoid) or their relative scores (softmax) as they were.
PRUNABLE_STRATEGIES = ("softmax_top_k", "sigmoid_top_k", "top_k_softmax")


def pruned_config(config: ModelConfig, keep: int) -> ModelConfig:
    """``config`` with ``keep`` routed experts per layer; a one-line ``ValueError`` where pruning is not defined."""
    moe = config.moe
    if moe is None or not any(FFN_KINDS.get(layer.ffn).routed for layer in config.layers):
        raise ValueError("the model has no routed experts (a dense model): there is nothing to prune")
    router = moe.router
    experts, top_k, groups = router.num_experts, router.top_k, router.expert_groups
    if router.strategy not in PRUNABLE_STRATEGIES:
        raise ValueError(
            f"routing strategy {router.strategy!r}: pruning is defined for softmax or sigmoid top-k routers "
            f"({' | '.join(PRUNABLE_STRATEGIES)})"
        )
    if router.capacity_factor is not None:
        raise ValueError("capacity routing: each expert's capacity depends on the expert count, pruning is not defined")
    if not top_k <= keep < experts:
        raise ValueError(
            f"keep {keep} experts: the layers have {experts} experts top-{top_k}; keep {top_k}..{experts - 1}"
        )
    if keep % groups:
        raise ValueError(
            f"keep {keep} experts: group-limited routing over {groups} groups of experts (n_group) needs a multiple "
            f"of {groups}"
        )
    try:
        return config.replace(moe=dataclasses.replace(moe, router=dataclasses.replace(router, num_experts=keep)))
    except ValueError as error:
        raise ValueError(f"keep {keep} experts: {error}") from None


def check_no_mtp(config: ModelConfig) -> None:
    """Refuse a model holding multi-token-prediction layers: their MoE would keep the old expert count."""
    if config.mtp_layers:
        raise ValueError(
            f"the model has {config.mtp_layers} multi-token-prediction layer(s), which pruning does not cut"
        )


def keep_count(num_experts: int, keep: int | None, ratio: float | None) -> int:
    """The experts to keep per layer from ``keep`` or ``ratio`` (the fraction removed), exactly one given."""
    if (keep is None) == (ratio is None):
        raise ValueError("give one of --keep N (experts kept per layer) or --ratio R (the fraction removed)")
    if keep is not None:
        return keep
    if not 0 < ratio < 1:
        raise ValueError(f"--ratio {ratio}: the fraction of experts removed must lie strictly between 0 and 1")
    return max(1, round(num_experts * (1 - ratio)))


def choose_kept(
    scores: Float[np.ndarray, "layers experts"], keep: int, groups: int = 1
) -> Int[np.ndarray, "layers keep"]:
    """The ``keep`` best-scoring experts of every layer (``keep / groups`` in each contiguous group), in increasing
    order; ties go to the lower expert number."""
    layers, experts = scores.shape
    size, per_group = experts // groups, keep // groups
    kept = []
    for layer in range(layers):
        chosen = []
        for group in range(groups):
            group_scores = scores[layer, group * size : (group + 1) * size]
            best = np.argsort(-group_scores, kind="stable")[:per_group]
            chosen.extend(group * size + best)
        kept.append(sorted(chosen))
    return np.asarray(kept, np.int32)


def merge_weights(
    stats: ExpertStats, kept: Int[np.ndarray, "layers keep"], groups: int = 1
) -> Float[np.ndarray, "layers keep experts"]:
    """Per layer, how each new expert is made from the old ones: row ``n`` holds the frequency weights (summing to 1)
    of kept expert ``kept[n]`` and of the removed experts nearest to it (see the module docstring)."""
    layers, experts = stats.counts.shape
    size = experts // groups
    means = stats.mean_outputs()
    unit = means / np.maximum(np.linalg.norm(means, axis=-1, keepdims=True), 1e-30)
    weights = np.zeros((layers, kept.shape[1], experts))
    for layer in range(layers):
        members = {int(t): [int(t)] for t in kept[layer]}
        for removed in sorted(set(range(experts)) - set(members)):
            candidates = [t for t in members if t // size == removed // size]
            similarity = [float(unit[layer, removed] @ unit[layer, t]) for t in candidates]
            members[candidates[int(np.argmax(similarity))]].append(removed)
        for row, target in enumerate(kept[layer]):
            group = members[int(target)]
            counts = stats.counts[layer, group]
            weights[layer, row, group] = counts / counts.sum() if counts.sum() > 0 else 1 / len(group)
    return weights


def merge_groups(weights: Float[np.ndarray, "layers keep experts"], kept: Int[np.ndarray, "layers keep"]) -> list:
    """Per layer, per kept expert, the removed experts folded into it (for the report)."""
    return [
        [[int(e) for e in np.flatnonzero(row) if e != target] for row, target in zip(layer, targets, strict=True)]
        for layer, targets in zip(weights, kept, strict=True)
    ]


def _path(key_path) -> tuple:
    return tuple(getattr(k, "name", getattr(k, "idx", None)) for k in key_path)


def prune_model(
    model: Transformer,
    kept: Int[np.ndarray, "layers keep"],
    merge: Float[np.ndarray, "layers keep experts"] | None = None,
    *,
    consume: bool = False,
) -> Transformer:
    """``model`` with every routed layer cut to its ``kept`` experts (rows in routed-layer order); with ``merge``, each
    kept expert's matrices are the ``merge``-weighted average of the old experts'. Arrays outside the routed layers
    are shared with ``model``, not copied. With ``consume`` each cut array of ``model`` is freed as soon as its
    replacement exists, so memory holds the model and one stacked array more, never both models (``model`` is
    unusable afterwards)."""
    check_no_mtp(model.config)
    config = pruned_config(model.config, kept.shape[1])
    ordinals: dict[tuple[int, int], list[int]] = {}
    count = 0
    for _, segment, _, position, kind in layer_slots(model.config):  # repeats in order within a (segment, position)
        if FFN_KINDS.get(kind.ffn).routed:
            ordinals.setdefault((segment, position), []).append(count)
            count += 1
    if count != len(kept) or (merge is not None and merge.shape[:2] != kept.shape):
        raise ValueError(f"prune_model: {len(kept)} rows of kept experts for {count} routed layers")
    if any("adapter" in _path(key_path) for key_path, _ in jax.tree_util.tree_leaves_with_path(model)):
        raise ValueError("the model carries LoRA adapters: merge them into its weights before pruning")

    def cut_array(leaf, part: str, layers: list[int]):
        # the router's gate weight [repeats, embed, experts], its gate bias and selection bias [repeats, experts]
        if part == "router":
            return jnp.stack([leaf[r][..., kept[layer]] for r, layer in enumerate(layers)])
        if merge is None:  # expert matrices and biases [repeats, experts, ...]
            return jnp.stack([leaf[r][kept[layer]] for r, layer in enumerate(layers)])
        mixing = jnp.asarray(merge[layers], jnp.float32)
        return jnp.einsum("rne,re...->rn...", mixing, leaf.astype(jnp.float32)).astype(leaf.dtype)

    def cut(key_path, leaf):
        path = _path(key_path)
        if len(path) < 6 or path[0] != "segments" or path[4] != "ffn" or path[5] not in ("router", "experts"):
            return leaf
        new = cut_array(leaf, path[5], ordinals[(path[1], path[3])])
        if consume:
            new.block_until_ready()
            leaf.delete()
        return new

    cut_model = jax.tree_util.tree_map_with_path(cut, model)
    abstract = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
    leaves = jax.tree.leaves(cut_model)
    new_leaves, structure = jax.tree.flatten(abstract)
    shapes = [(leaf.shape, leaf.dtype) for leaf in leaves]
    if shapes != [(leaf.shape, leaf.dtype) for leaf in new_leaves]:
        raise ValueError("prune_model: the cut parameters do not have the pruned config's shapes")
    return jax.tree.unflatten(structure, leaves)
