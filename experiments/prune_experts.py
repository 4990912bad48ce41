"""Make a trained MoE smaller: remove (or merge) the routed experts a criterion scores lowest on calibration data.

    python -m experiments.prune_experts --hf MOE_DIR --keep 4 --out-dir runs/pruned                 # REAP, built-in
    python -m experiments.prune_experts --hf MOE_DIR --data notes.jsonl --ratio 0.5 --criterion frequency --merge
    python -m experiments.prune_experts --checkpoint runs/pretrain/checkpoints --keep 4 --criterion router-weight

The model comes from ``--hf`` (a Hugging Face folder of any family with routed experts) or ``--checkpoint``. The
calibration data is ``--data`` (text files, one document each, or JSONL files of ``{"text", "domain"}``, as
``experiments.pretrain`` reads them; conversation JSONL files as ``experiments.sft`` reads them, each rendered by the
tokenizer's chat template) or, by default, the training split of the built-in corpus; documents are packed
as pretraining packs them, and rows drawn in a ``--seed``-ed random order until ``--calibration-tokens`` real tokens
(the last row cut to the budget). The model runs on them one layer at a time in float32
(:mod:`eqmoe.surgery.expert_stats`), and each routed expert gets a score per layer:

- ``reap`` (REAP, Lasby et al. 2025): the mean, over the calibration tokens routed to the expert, of its gate value
  (the combine weight the model gives it) times the L2 norm of its output;
- ``frequency``: the share of calibration tokens routed to it;
- ``router-weight``: its gate values summed over the tokens routed to it, per calibration token;
- ``ean``: its output norms summed over the tokens routed to it, per calibration token (REAP's EAN baseline).

Every layer keeps its ``--keep`` best experts (or ``1 - --ratio`` of them; the same count in every layer), in their
original order; the router's columns (and its gate and selection biases) and the expert matrices are cut to them,
shared experts untouched. ``--merge`` folds each removed expert into the kept one whose mean calibration output is
nearest by cosine similarity, averaging their matrices weighted by their calibration token counts
(:mod:`eqmoe.surgery.prune`).

Writes ``--out-dir``: a Hugging Face folder of the model's family with the new expert count (``config.json``, the
safetensors in the source's dtype, its tokenizer and generation files) that transformers loads, plus
``expert_scores.json`` (every score, the kept experts, the merges) and ``expert_scores.png`` (layers x experts, the
kept ones marked), assembled under a temporary name and renamed. Prints the score table. Pruning is refused in one
line (exit 2, nothing written) for a model without routed experts, a keep count outside ``top_k..experts-1``, and
routing the expert count cannot be cut from (capacity routing, group-limited routing whose ``n_group`` does not
divide the kept count, multi-token-prediction layers).
"""

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

from eqmoe.checkpoints import hf
from eqmoe.checkpoints.source import load_source, source_tokenizer
from eqmoe.data.chat import render
from eqmoe.data.corpus import Document, load_documents, pack_documents, synthetic_documents
from eqmoe.data.formats import read_conversations
from eqmoe.data.records import iter_records
from eqmoe.data.tokenizer import check_tokenizer_fits
from eqmoe.models import family as families
from eqmoe.surgery import prune
from eqmoe.surgery.expert_stats import CRITERIA, Batch, Criterion, ExpertStats, collect_expert_stats
from eqmoe.train.logging import new_figure, save_figure, write_json_atomic
from eqmoe.train.loop import OutputOptions
from experiments._cli import UsageError, guarded
from experiments.options import ModelSourceOptions, ShapeOptions, TokenizerOption


@dataclass(frozen=True)
class Args(ModelSourceOptions, TokenizerOption, ShapeOptions, OutputOptions):
    out_dir: Path = Path("runs/pruned")
    batch_size: int = 8

    keep: int | None = None
    """Routed experts kept in every layer."""
    ratio: float | None = None
    """Instead of --keep: the fraction of each layer's routed experts removed (0.5 keeps half)."""
    criterion: Criterion = "reap"
    """What decides which experts stay: reap (mean gate value x output norm over the tokens routed to the expert),
    frequency (share of tokens routed to it), router-weight (its summed gate values per token) or ean (its summed
    output norms per token)."""
    merge: bool = False
    """Fold each removed expert into its nearest kept expert (cosine of mean outputs), frequency-weighted, instead of
    dropping it."""

    data: tuple[Path, ...] = ()
    """Calibration text files (one document each), JSONL files of {"text", "domain"}, or conversation JSONL files
    (messages, ShareGPT, prompt/completion: rendered by the chat template) (default: the built-in corpus's training
    split)."""
    calibration_tokens: int = 8192
    """Real tokens of calibration data the statistics are taken over (fewer when the data runs out)."""
    chars_per_domain: int = 100_000
    """Built-in corpus: characters of each domain's training split to draw calibration rows from."""
    seed: int = 0
    """Seed of the calibration rows' order (and of the built-in corpus's text)."""
    save_dtype: str | None = None
    """Dtype of the written tensors (float32, bfloat16, float16; default: the source's, as it is held)."""
    overwrite: bool = False
    """Replace an existing --out-dir instead of refusing."""


def calibration_documents(paths: tuple[Path, ...], tokenizer) -> list[Document]:
    """The documents of text files and ``{"text"}`` JSONL files (as ``pretrain`` reads them), and of conversation
    files (as ``sft`` reads them: messages, ShareGPT or prompt/completion records), each conversation rendered by the
    tokenizer's chat template as the model sees it in fine-tuning."""
    documents = []
    for path in paths:
        first = next(iter_records(path), None) if path.is_file() and path.suffix == ".jsonl" else None
        if first is None or "text" in first.record:
            documents += load_documents([path])
            continue
        conversations = read_conversations(path)
        documents += [Document(render(item.conversation, tokenizer), path.stem) for item in conversations.items]
    return documents


def calibration_batches(args: Args, tokenizer) -> list[Batch]:
    """Rows holding ``--calibration-tokens`` real tokens in a seeded random order, in batches of ``--batch-size``
    (the last filled with padding rows, so every batch compiles once)."""
    if args.data:
        documents = calibration_documents(args.data, tokenizer)
    else:
        documents = synthetic_documents("train", args.chars_per_domain, args.seed)
    rows = pack_documents(documents, tokenizer, args.seq_len).packed.rows
    order = np.random.default_rng(args.seed).permutation(len(rows.tokens))
    tokens, segment_ids, positions = (
        np.asarray(array)[order] for array in (rows.tokens, rows.segment_ids, rows.positions)
    )
    real = segment_ids > 0  # the permuted rows are a copy: the cut below leaves the packed data alone
    budget = np.cumsum(real.reshape(-1)).reshape(real.shape) <= args.calibration_tokens
    segment_ids[~budget] = 0
    used = int(np.flatnonzero((segment_ids > 0).any(axis=1)).max(initial=-1)) + 1
    batches = []
    for start in range(0, used, args.batch_size):
        index = np.arange(start, start + args.batch_size)
        present = index < used
        index = np.minimum(index, used - 1)
        batches.append(
            Batch(tokens[index], np.where(present[:, None], segment_ids[index], 0), positions[index].astype(np.int32))
        )
    return batches


def _check(args: Args) -> None:
    for name in ("calibration_tokens", "batch_size", "chars_per_domain"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.seq_len < 2:
        raise UsageError(f"--seq-len {args.seq_len}: must be at least 2")
    if args.save_dtype not in (None, "float32", "bfloat16", "float16"):
        raise UsageError(f"--save-dtype {args.save_dtype}: allowed: float32 | bfloat16 | float16")
    if args.out_dir.exists() and not args.overwrite:
        raise UsageError(f"{args.out_dir} already exists (--overwrite replaces it)")


def score_table(scores: np.ndarray, kept: np.ndarray, layers: np.ndarray, criterion: str, show: int = 16) -> str:
    """Layers x experts, kept experts starred; past ``show`` experts, the ``show // 2`` best and worst of each layer."""
    experts = scores.shape[1]
    lines = [f"{criterion} scores (* kept) per layer x expert"]
    if experts <= show:
        lines.append("layer " + "".join(f"{e:>11}" for e in range(experts)))
        for layer, row, chosen in zip(layers, scores, kept, strict=True):
            cells = "".join(f"{value:>10.4g}{'*' if e in chosen else ' '}" for e, value in enumerate(row))
            lines.append(f"{layer:>5} {cells}")
        return "\n".join(lines)
    half = show // 2
    for layer, row, chosen in zip(layers, scores, kept, strict=True):
        order = np.argsort(-row, kind="stable")
        best = " ".join(f"{e}:{row[e]:.4g}" for e in order[:half])
        worst = " ".join(f"{e}:{row[e]:.4g}{'*' if e in chosen else ''}" for e in order[-half:])
        lines.append(f"layer {layer}: best {best} | worst {worst}")
    return "\n".join(lines)


def plot_scores(scores: np.ndarray, kept: np.ndarray, layers: np.ndarray, criterion: str, path: Path) -> None:
    """A layers x experts heatmap of the scores (each layer scaled to its best), kept experts outlined."""
    figure = new_figure(figsize=(max(4.0, 0.35 * scores.shape[1] + 2), max(2.5, 0.4 * len(layers) + 1.5)))
    axes = figure.add_subplot()
    scaled = scores / np.maximum(scores.max(axis=1, keepdims=True), 1e-30)
    image = axes.imshow(scaled, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    for row, chosen in enumerate(kept):
        for expert in chosen:
            axes.add_patch(_outline(expert, row))
    axes.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    axes.set_xlabel("expert")
    axes.set_ylabel("layer")
    axes.set_title(f"{criterion} score / layer's best (outlined: kept)")
    figure.colorbar(image, ax=axes)
    figure.tight_layout()
    save_figure(figure, path)


def _outline(x: int, y: int):
    from matplotlib.patches import Rectangle

    return Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.5)


def _report(stats: ExpertStats, args: Args, kept: np.ndarray, merge: np.ndarray | None, source: str) -> dict:
    return {
        "source": source,
        "criterion": args.criterion,
        "merge": args.merge,
        "calibration_tokens": stats.tokens,
        "seed": args.seed,
        "layers": stats.layers.tolist(),
        "scores": {name: stats.scores(name).tolist() for name in CRITERIA},
        "token_counts": stats.counts.astype(int).tolist(),
        "kept": kept.tolist(),
        "merged_into_kept": None if merge is None else prune.merge_groups(merge, kept),
    }


def _keep(config, args: Args) -> int:
    """The experts kept per layer; a one-line error where the request or the model cannot be pruned."""
    experts = config.moe.router.num_experts if config.moe is not None else 0
    keep = prune.keep_count(experts, args.keep, args.ratio)
    prune.pruned_config(config, keep)
    if families.get(config.family).hf_model_type is None:
        raise UsageError(f"model family {config.family!r} has no Hugging Face format to write the pruned model in")
    return keep


def run(args: Args) -> dict:
    _check(args)
    if args.hf is not None and args.checkpoint is None:  # refuse from config.json, before reading any weight
        _keep(hf.read_config(args.hf), args)
    source = load_source(hf_folder=args.hf, checkpoint=args.checkpoint, step=args.step, base=args.base)
    model, folder = source.model, source.folder
    source = source._replace(model=None)  # the model alone holds the parameters, so they go once it is pruned
    config = model.config
    keep = _keep(config, args)
    prune.check_no_mtp(config)  # before the calibration pass
    tokenizer = source_tokenizer(source, args.tokenizer, chat=False, bytes_if_none=True)
    check_tokenizer_fits(tokenizer.vocab_size, config.vocab_size)
    stats = collect_expert_stats(model, calibration_batches(args, tokenizer))
    groups = config.moe.router.expert_groups
    kept = prune.choose_kept(stats.scores(args.criterion), keep, groups)
    merge = prune.merge_weights(stats, kept, groups) if args.merge else None
    pruned = prune.prune_model(model, kept, merge, consume=True)
    del model
    report = _report(stats, args, kept, merge, str(folder))
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        write_json_atomic(scratch / "expert_scores.json", report)
        plot_scores(stats.scores(args.criterion), kept, stats.layers, args.criterion, scratch / "expert_scores.png")
        extra = [*hf.side_files(folder), scratch / "expert_scores.json", scratch / "expert_scores.png"]
        hf.save(pruned, args.out_dir, dtype=args.save_dtype, overwrite=args.overwrite, extra_files=extra)
    print(score_table(stats.scores(args.criterion), kept, stats.layers, args.criterion))
    action = "merged into" if args.merge else "pruned to"
    experts = config.moe.router.num_experts
    print(
        f"{experts} routed experts per layer {action} {keep} by {args.criterion} over {stats.tokens:,} calibration "
        f"tokens; wrote {args.out_dir} (expert_scores.json, expert_scores.png)"
    )
    return report


def main(args: Args) -> int:
    return 0 if guarded("prune_experts", run, args) is not None else 2


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
