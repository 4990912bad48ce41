"""Next-token pretraining of any preset on packed text, with routing statistics per layer and domain.

    python -m experiments.pretrain                                  # qwen3-moe-micro on the built-in corpus
    python -m experiments.pretrain --override moe.router.top_k=1 moe.router.renormalize=false
    python -m experiments.pretrain --data notes.txt corpus.jsonl --tokenizer tokenizer.json
    python -m experiments.pretrain --steps 2000 --resume            # continue the run in --out-dir

The built-in data is a deterministic multi-domain corpus (arithmetic, a small grammar, copy/reverse
strings, Python standard library source; see ``eqmoe.data.corpus``), so it is measurable whether
experts specialise by domain. ``--override FIELD.PATH=VALUE`` changes any model config field of the
preset (the value is JSON, or bare text).

Outputs in ``--out-dir``: ``metrics.jsonl`` (training terms every ``--log-every`` steps; eval loss and
routing statistics every ``--eval-every`` steps), ``metrics.png``, ``routing.png`` (which experts each
domain's tokens chose, per layer), ``checkpoints/`` and ``summary.json``.
"""

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import jax
import numpy as np
import tyro

from eqmoe import Transformer, presets
from eqmoe.analysis.evaluate import plot_domain_routing, routing_metrics
from eqmoe.checkpoints.run_metadata import RunMetadata
from eqmoe.config_io import apply_overrides, config_to_dict, parse_override
from eqmoe.data import PackedDataset, load_tokenizer
from eqmoe.data.corpus import (
    EVAL_CHARS_PER_DOMAIN,
    load_documents,
    pack_documents,
    split_documents,
    synthetic_documents,
)
from eqmoe.train import loop
from eqmoe.train.logging import plot_metrics, write_json_atomic
from eqmoe.train.optimizer import OptimizerConfig
from experiments._cli import MeshOptions, UsageError, guarded


@dataclass(frozen=True)
class ModelOptions:
    preset: str = "qwen3-moe-micro"
    """Model preset to train from scratch."""
    override: tuple[str, ...] = ()
    """Config changes FIELD.PATH=VALUE, e.g. moe.router.top_k=1 norm.ffn_placement=post."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype (parameters and optimizer state stay float32)."""
    remat: Literal["none", "block"] = "none"
    """Recompute each layer unit's activations in the backward pass to save memory."""


@dataclass(frozen=True)
class DataOptions:
    data: tuple[Path, ...] = ()
    """Text files (one document each) or JSONL files of {"text", "domain"} (default: the built-in corpus)."""
    tokenizer: Path | None = None
    """A Hugging Face tokenizer.json (default: bytes, 260 ids)."""
    seq_len: int = 128
    """Tokens per packed row."""
    batch_size: int = 16
    """Rows per step."""
    chars_per_domain: int = 400_000
    """Built-in corpus: training characters of each domain."""
    eval_chars_per_domain: int = EVAL_CHARS_PER_DOMAIN
    """Built-in corpus: held-out characters of each domain."""


@dataclass(frozen=True)
class RunOptions(loop.RunOptions):
    steps: int = 600
    """Total optimizer steps of the run (a resumed run continues up to this)."""
    out_dir: Path = Path("runs/pretrain")
    """Where metrics, plots, checkpoints and the summary go."""
    checkpoint_every: int = 200
    """Save a checkpoint every N steps (and at the end)."""
    eval_every: int = 200
    """Evaluate on the held-out set every N steps (and at the end)."""


@dataclass(frozen=True)
class Args:
    model: ModelOptions = ModelOptions()
    data: DataOptions = DataOptions()
    optim: OptimizerConfig = OptimizerConfig(learning_rate=3e-3, warmup_steps=50, decay_steps=600, weight_decay=0.01)
    run: RunOptions = RunOptions()
    parallel: MeshOptions = MeshOptions()


def model_config(options: ModelOptions):
    """The preset with ``--override`` applied (and the dtype and remat options)."""
    config = presets.get(options.preset).replace(dtype=options.dtype, param_dtype="float32", remat=options.remat)
    return apply_overrides(config, dict(parse_override(text) for text in options.override))


def _documents(options: DataOptions, seed: int):
    if not options.data:
        train = synthetic_documents("train", options.chars_per_domain, seed)
        return train, synthetic_documents("eval", options.eval_chars_per_domain, seed), "built-in corpus"
    documents = load_documents(options.data)
    train, held_out = split_documents(documents)
    return train, held_out, f"{len(documents)} documents from {len(options.data)} file(s)"


def run(args: Args) -> dict:
    """Train, evaluate and write every output; returns the summary."""
    options, out_dir = args.run, args.run.out_dir
    options.check()
    parallelism = args.parallel.build()
    try:
        config = model_config(args.model)
    except ValueError as error:
        raise UsageError(str(error)) from None
    tokenizer = load_tokenizer(args.data.tokenizer)
    if tokenizer.vocab_size > config.vocab_size:
        raise UsageError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is {config.vocab_size}"
        )
    train_docs, held_out_docs, note = _documents(args.data, options.seed)
    train = pack_documents(train_docs, tokenizer, args.data.seq_len)
    held_out = pack_documents(held_out_docs, tokenizer, args.data.seq_len, domains=train.domains)
    dataset = PackedDataset(train.packed.rows)
    print(
        f"data: {note}; domains {', '.join(train.domains)}; {len(dataset)} training rows of {args.data.seq_len} "
        f"({train.packed.fill:.0%} filled), {len(held_out.packed.rows.tokens)} held-out rows",
        file=sys.stderr,
    )

    def evaluate_model(model):
        rows, labels = held_out.packed.rows, held_out.packed.labels
        return routing_metrics(model, rows, labels, len(train.domains), args.data.batch_size)

    model = Transformer(config, key=jax.random.key(options.seed))
    result = loop.train(
        model,
        args.optim,
        options,
        dataset=dataset,
        batch_size=args.data.batch_size,
        evaluate=evaluate_model,
        # what generate, convert and analyze_routing decode the run's text with
        metadata=RunMetadata(
            config,
            tokenizer=None if args.data.tokenizer is None else str(args.data.tokenizer.absolute()),
            bytes_tokenizer=args.data.tokenizer is None,
        ),
        parallelism=parallelism,
        arguments=dataclasses.asdict(args),
    )
    final = dict(result.final_eval)  # the per-layer statistics ("layers") are not in metrics.jsonl
    if jax.process_index() == 0:
        plot_metrics(result.metrics.records(), out_dir / "metrics.png")
    layers = final.pop("layers", None)
    if layers is not None and jax.process_index() == 0:
        plot_domain_routing(
            np.asarray(layers["domain_counts"]), train.domains, out_dir / "routing.png", layers["domain_nmi"]
        )
    summary = {
        "final_loss": result.last_terms.get("loss", float("nan")),
        **final,
        "layers": layers,
        "domains": list(train.domains),
        "steps": options.steps,
        "tokens_per_step": args.data.batch_size * args.data.seq_len,
        "tokens_per_second": result.tokens_per_second,
        "compile_seconds": result.compile_seconds,
        "overrides": dict(parse_override(text) for text in args.model.override),
        "config": config_to_dict(config),
        "args": dataclasses.asdict(args),
    }
    if jax.process_index() == 0:
        write_json_atomic(out_dir / "summary.json", summary)
    return summary


def main(args: Args) -> int:
    summary = guarded("pretrain", run, args)
    if summary is None:
        return 2
    line = f"final loss {summary['final_loss']:.4f}  eval loss {summary['eval_loss']:.4f}"
    if "eval_load_cv" in summary:
        line += (
            f"  load CV {summary['eval_load_cv']:.3f}  dropped {summary['eval_dropped_fraction']:.3f}"
            f"  domain NMI {summary['eval_domain_nmi']:.3f}"
        )
    print(f"{line}  ({summary['tokens_per_second'] or 0:,.0f} tok/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args, config=(tyro.conf.OmitArgPrefixes,))))
