"""Held-out loss of a MoE before and after expert pruning, for every criterion, with and without merging, over
calibration seeds.

    python -m experiments.pretrain --out-dir runs/prune-base                      # a small MoE of our own (~3 min)
    python -m experiments.convert --checkpoint runs/prune-base/checkpoints --to-hf runs/prune-base-hf
    python -m experiments.compare_pruning --hf runs/prune-base-hf --keep 4 --seeds 3

Each seed draws its own calibration sample (``experiments.prune_experts``'s: the built-in corpus's training split, or
``--data``, in that seed's order) and takes the expert statistics once; every criterion (REAP, frequency,
router-weight, EAN, and a seeded random choice as the reference) then cuts the model to ``--keep`` experts per layer, by
dropping the others or by merging them (``--merge`` of ``prune_experts``), and the cut model's loss is measured on the
held-out split of the built-in corpus (every held-out row, token-weighted, as ``experiments.pretrain`` evaluates),
the same rows for every arm. Prints a Markdown table (mean ± sample standard deviation over seeds) and writes
``results.json`` to ``--out-dir``. The models are cut in memory, as ``prune_experts`` cuts them before writing.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

from eqmoe.analysis.evaluate import routing_metrics
from eqmoe.checkpoints.source import load_source, source_tokenizer
from eqmoe.data.corpus import EVAL_CHARS_PER_DOMAIN, pack_documents, synthetic_documents
from eqmoe.surgery import prune
from eqmoe.surgery.expert_stats import CRITERIA, collect_expert_stats
from eqmoe.train.logging import write_json_atomic
from eqmoe.train.loop import OutputOptions
from experiments import prune_experts
from experiments._cli import UsageError, guarded
from experiments.options import ModelSourceOptions, ShapeOptions


@dataclass(frozen=True)
class Args(ModelSourceOptions, ShapeOptions, OutputOptions):
    out_dir: Path = Path("runs/compare_pruning")
    batch_size: int = 8
    keep: int = 4
    """Routed experts kept in every layer."""
    seeds: int = 3
    """Calibration samples (seeds 0, 1, ...)."""
    calibration_tokens: int = 8192
    data: tuple[Path, ...] = ()
    """Calibration text or JSONL files (default: the built-in corpus's training split)."""
    eval_chars_per_domain: int = EVAL_CHARS_PER_DOMAIN
    """Built-in corpus: held-out characters of each domain."""


def _held_out(tokenizer, seq_len: int, chars: int):
    packed = pack_documents(synthetic_documents("eval", chars, 0), tokenizer, seq_len)
    return packed.packed.rows, packed.packed.labels, len(packed.domains)


def run(args: Args) -> dict:
    if args.seeds < 1:
        raise UsageError(f"--seeds {args.seeds}: must be at least 1")
    source = load_source(hf_folder=args.hf, checkpoint=args.checkpoint, step=args.step, base=args.base)
    model = source.model
    tokenizer = source_tokenizer(source, chat=False, bytes_if_none=True)
    config = model.config
    prune.pruned_config(config, args.keep)
    rows, labels, domains = _held_out(tokenizer, args.seq_len, args.eval_chars_per_domain)

    def held_out_loss(candidate) -> float:
        return routing_metrics(candidate, rows, labels, domains, args.batch_size)["eval_loss"]

    baseline = held_out_loss(model)
    groups = config.moe.router.expert_groups
    losses: dict[str, list[float]] = {}
    for seed in range(args.seeds):
        calibration = prune_experts.Args(
            data=args.data, calibration_tokens=args.calibration_tokens, seed=seed, seq_len=args.seq_len
        )
        stats = collect_expert_stats(model, prune_experts.calibration_batches(calibration, tokenizer))
        experts = stats.counts.shape[1]
        random_scores = np.random.default_rng(seed).random((len(stats.layers), experts))
        for criterion in (*CRITERIA, "random"):
            scores = random_scores if criterion == "random" else stats.scores(criterion)
            kept = prune.choose_kept(scores, args.keep, groups)
            for merge in (False, True):
                cut = prune.prune_model(model, kept, prune.merge_weights(stats, kept, groups) if merge else None)
                name = f"{criterion}{' + merge' if merge else ''}"
                losses.setdefault(name, []).append(held_out_loss(cut))
                print(f"seed {seed}  {name:<22} held-out loss {losses[name][-1]:.4f}", flush=True)
    results = {
        "model": str(source.folder),
        "experts": config.moe.router.num_experts,
        "keep": args.keep,
        "calibration_tokens": args.calibration_tokens,
        "seeds": args.seeds,
        "held_out_tokens": int((rows.segment_ids > 0).sum()),
        "unpruned": baseline,
        "pruned": losses,
    }
    write_json_atomic(args.out_dir / "results.json", results)
    return results


def table(results: dict) -> str:
    seeds = results["seeds"]
    lines = [
        f"Held-out loss, {results['experts']} -> {results['keep']} experts per layer, {seeds} calibration seed(s) of "
        f"{results['calibration_tokens']:,} tokens ({results['held_out_tokens']:,} held-out tokens)",
        "",
        "| arm | held-out loss (mean ± sd) | vs unpruned |",
        "|---|---|---|",
        f"| unpruned | {results['unpruned']:.4f} | |",
    ]
    for name, values in results["pruned"].items():
        mean = float(np.mean(values))
        spread = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
        lines.append(f"| {name} | {mean:.4f} ± {spread:.4f} | {mean - results['unpruned']:+.4f} |")
    return "\n".join(lines)


def main(args: Args) -> int:
    results = guarded("compare_pruning", run, args)
    if results is None:
        return 2
    print(table(results))
    print(f"wrote {args.out_dir / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
