"""Supervised fine-tuning (SFT) of a Qwen3-MoE on chat data: the main job.

    python -m experiments.sft                                   # tiny model, built-in tasks, ~4 min on CPU
    python -m experiments.sft --init-from-hf DIR --data chats.jsonl --tokenizer DIR/tokenizer.json
    python -m experiments.sft --init-from-checkpoint CKPT --data chats.jsonl --tokenizer CKPT/tokenizer.json
    python -m experiments.sft --steps 4000 --resume             # continue the run in --out-dir

With no arguments it trains the ``qwen3-moe-micro`` preset from scratch on built-in synthetic chat tasks
(addition, reversal, sorting, largest digit) and reports held-out exact match of greedy answers. Only
assistant tokens count in the loss. Outputs in ``--out-dir``: ``metrics.jsonl``, ``metrics.png``,
``checkpoints/`` (orbax, keep-last-N), ``summary.json``.
"""

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import tyro

from eqmoe import Transformer, parallel, presets
from eqmoe.checkpoints import hf
from eqmoe.checkpoints.model_checkpoint import load_model
from eqmoe.config import ModelConfig
from eqmoe.config_io import config_to_dict
from eqmoe.data import (
    TRAIN_MIX,
    PackedDataset,
    TaskKind,
    distinct_kinds,
    load_jsonl,
    load_tokenizer,
    pack_conversations,
    prompt_ids,
    synthetic_split,
)
from eqmoe.train import loop
from eqmoe.train.logging import plot_metrics, write_json_atomic
from eqmoe.train.optimizer import OptimizerConfig
from eqmoe.train.step import eval_step, held_out_batches
from experiments._cli import MeshOptions, UsageError, guarded


@dataclass(frozen=True)
class ModelOptions:
    preset: str = "qwen3-moe-micro"
    """Model preset to train from scratch (ignored with --init-from-hf)."""
    init_from_hf: Path | None = None
    """Start from this Hugging Face Qwen3-MoE folder (config.json + safetensors) instead of a preset."""
    init_from_checkpoint: Path | None = None
    """Start from this eqmoe checkpoint (experiments.convert output or another run's checkpoints folder)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype (parameters and optimizer state stay float32)."""
    remat: Literal["none", "block"] = "none"
    """Recompute each layer unit's activations in the backward pass to save memory."""
    dispatch: str | None = None
    """MoE dispatch backend: auto or one registered in eqmoe.nn.dispatch.BACKENDS (dense, sorted, ragged_dot,
    capacity); default: the model's. Like --dtype and --remat it may change on --resume."""


def execution_config(config: ModelConfig, options: ModelOptions) -> ModelConfig:
    """``config`` with the execution options (``--dtype``, ``--remat``, ``--dispatch``) and float32 parameters."""
    config = config.replace(dtype=options.dtype, param_dtype="float32", remat=options.remat)
    if options.dispatch is None:
        return config
    if config.moe is None:
        raise UsageError("--dispatch: the model has no MoE layers")
    try:
        return config.replace(moe=dataclasses.replace(config.moe, dispatch=options.dispatch))
    except ValueError as error:
        raise UsageError(f"--dispatch: {error}") from None


@dataclass(frozen=True)
class DataOptions:
    data: Path | None = None
    """Training conversations, JSONL of {"messages": [{"role", "content"}]} (default: built-in tasks)."""
    eval_data: Path | None = None
    """Held-out conversations (default: every 20th conversation of --data, or the built-in eval split)."""
    tokenizer: Path | None = None
    """A Hugging Face tokenizer.json (default: bytes, 260 ids)."""
    seq_len: int = 128
    """Tokens per packed row."""
    batch_size: int = 16
    """Rows per step."""
    train_examples: int = 50_000
    """Built-in tasks: training conversations to generate."""
    eval_examples: int = 500
    """Built-in tasks: held-out conversations to generate."""
    tasks: tuple[TaskKind, ...] = TRAIN_MIX
    """Built-in tasks: the training cycle of task kinds (a kind listed twice is drawn twice as often); the
    held-out conversations cycle through each listed kind once."""


@dataclass(frozen=True)
class RunOptions(loop.RunOptions):
    steps: int = 2000
    """Total optimizer steps of the run (a resumed run continues up to this)."""
    out_dir: Path = Path("runs/sft")
    """Where metrics, plots, checkpoints and the summary go."""
    samples: int = 4
    """Held-out prompts to answer with greedy generation at the end."""


@dataclass(frozen=True)
class Args:
    model: ModelOptions = ModelOptions()
    data: DataOptions = DataOptions()
    optim: OptimizerConfig = OptimizerConfig(learning_rate=3e-3, warmup_steps=100, decay_steps=2000, weight_decay=0.1)
    run: RunOptions = RunOptions()
    parallel: MeshOptions = MeshOptions()


def _model_and_config(options: ModelOptions, vocab_size: int, seed: int) -> tuple[Transformer, ModelConfig]:
    if options.init_from_hf is not None and options.init_from_checkpoint is not None:
        raise UsageError("give --init-from-hf or --init-from-checkpoint, not both")
    if options.init_from_hf is not None or options.init_from_checkpoint is not None:
        if options.init_from_hf is not None:
            model = hf.load(options.init_from_hf)
        else:
            model, _ = load_model(options.init_from_checkpoint, dtype="float32")
        config = execution_config(model.config, options)
        model = model.with_config(config)
    else:
        config = execution_config(presets.get(options.preset), options)
        model = Transformer(config, key=jax.random.key(seed))
    if vocab_size > config.vocab_size:
        raise UsageError(f"the tokenizer has {vocab_size} ids but the model's vocabulary is {config.vocab_size}")
    return model, config


def _conversations(options: DataOptions, seed: int):
    """Training and held-out conversations, a note of what was skipped, and each held-out conversation's
    task kind (built-in tasks only, else ``None``)."""
    if options.data is None:
        train = [e.messages for e in synthetic_split("train", options.train_examples, seed, options.tasks)]
        held_out_examples = synthetic_split("eval", options.eval_examples, seed, distinct_kinds(options.tasks))
        held_out = [e.messages for e in held_out_examples]
        return train, held_out, "built-in tasks", [e.task for e in held_out_examples]
    loaded = load_jsonl(options.data)
    note = f"{options.data}: {len(loaded.conversations)} conversations"
    if loaded.skipped_no_assistant:
        note += f", {loaded.skipped_no_assistant} skipped (no assistant turn)"
    if options.eval_data is not None:
        return loaded.conversations, load_jsonl(options.eval_data).conversations, note, None
    train = [c for i, c in enumerate(loaded.conversations) if i % 20 != 19]
    held_out = [c for i, c in enumerate(loaded.conversations) if i % 20 == 19] or loaded.conversations[:1]
    return train, held_out, note, None


def _evaluate(model: Transformer, rows, batch_size: int) -> dict[str, float]:
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


def _samples(model: Transformer, tokenizer, conversations, count: int) -> list[dict[str, str]]:
    from eqmoe.inference import generate

    samples = []
    for messages in conversations[:count]:
        prompt = prompt_ids(messages[:-1], tokenizer)
        output = generate(
            model,
            jnp.asarray(prompt)[None],
            max_new_tokens=32,
            eos_id=tokenizer.im_end_id,
            vocab_limit=tokenizer.vocab_size,
        )
        new = [int(t) for t in np.asarray(output[0, len(prompt) :])]
        if tokenizer.im_end_id in new:
            new = new[: new.index(tokenizer.im_end_id)]
        samples.append(
            {"prompt": messages[-2]["content"], "expected": messages[-1]["content"], "generated": tokenizer.decode(new)}
        )
    return samples


def run(args: Args) -> dict:
    """Train, evaluate and write every output; returns the summary."""
    run_options, out_dir = args.run, args.run.out_dir
    run_options.check()
    parallelism = args.parallel.build()
    tokenizer = load_tokenizer(args.data.tokenizer)
    model, config = _model_and_config(args.model, tokenizer.vocab_size, run_options.seed)
    train, held_out, note, held_out_tasks = _conversations(args.data, run_options.seed)
    packed = pack_conversations(train, tokenizer, args.data.seq_len, overflow="truncate")
    eval_rows = pack_conversations(held_out, tokenizer, args.data.seq_len, overflow="truncate").rows
    dataset = PackedDataset(packed.rows)
    print(
        f"data: {note}; {packed.num_conversations} packed into {len(dataset)} rows of {args.data.seq_len} "
        f"({packed.fill:.0%} filled, {packed.too_long} truncated); {len(held_out)} held out",
        file=sys.stderr,
    )

    tokenizer_path = None if args.data.tokenizer is None else str(args.data.tokenizer.absolute())
    result = loop.train(
        model,
        args.optim,
        run_options,
        dataset=dataset,
        batch_size=args.data.batch_size,
        evaluate=lambda model: _evaluate(model, eval_rows, args.data.batch_size),
        metadata={"tokenizer": tokenizer_path},
        parallelism=parallelism,
    )
    model = result.state.model
    if jax.process_index() == 0:
        plot_metrics(result.metrics.records(), out_dir / "metrics.png")
    samples = _samples(model, tokenizer, held_out, run_options.samples) if run_options.samples else []
    by_task = {}
    for task in sorted(set(held_out_tasks or ())):
        rows = pack_conversations(
            [c for c, t in zip(held_out, held_out_tasks, strict=True) if t == task],
            tokenizer,
            args.data.seq_len,
            overflow="truncate",
        ).rows
        by_task[task] = _evaluate(model, rows, args.data.batch_size)["eval_accuracy"]
    summary = {
        "final_loss": result.last_terms.get("loss", float("nan")),
        "eval_loss": result.final_eval["eval_loss"],
        "eval_accuracy": result.final_eval["eval_accuracy"],
        "eval_accuracy_by_task": by_task,
        "steps": run_options.steps,
        "tokens_per_second": result.tokens_per_second,
        "compile_seconds": result.compile_seconds,
        "held_out_conversations": len(held_out),
        "samples": samples,
        "config": config_to_dict(config),
        "args": dataclasses.asdict(args),
    }
    if jax.process_index() == 0:
        write_json_atomic(out_dir / "summary.json", summary)
    return summary


def main(args: Args) -> int:
    summary = guarded("sft", run, args)
    if summary is None:
        return 2
    for sample in summary["samples"]:
        print(f"  {sample['prompt']!r} -> {sample['generated']!r} (expected {sample['expected']!r})")
    print(
        f"final loss {summary['final_loss']:.4f}  eval loss {summary['eval_loss']:.4f}  "
        f"held-out exact match {summary['eval_accuracy']:.3f}  ({summary['tokens_per_second'] or 0:,.0f} tok/s)"
    )
    by_task = summary["eval_accuracy_by_task"]
    if by_task:
        print("  held-out exact match by task: " + "  ".join(f"{task} {value:.3f}" for task, value in by_task.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args, config=(tyro.conf.OmitArgPrefixes,))))
