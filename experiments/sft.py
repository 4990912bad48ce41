"""Supervised fine-tuning (SFT) of a MoE model on chat data: the main job.

    python -m experiments.sft                                   # tiny model, built-in tasks, ~3 min on CPU
    python -m experiments.sft --init-from-hf DIR --tokenizer DIR --data chats.parquet
    python -m experiments.sft --init-from-checkpoint CKPT --tokenizer DIR --data sharegpt.json \\
        --template-var enable_thinking=false
    python -m experiments.sft --steps 4000 --resume             # continue the run in --out-dir

With no arguments it trains the ``qwen3-moe-micro`` preset from scratch on built-in synthetic chat tasks
(addition, reversal, sorting, largest digit) and reports held-out exact match of greedy answers.
Conversations are rendered with the tokenizer's own chat template (``--chat-template`` replaces it; the byte
tokenizer's is the built-in ChatML) and only what the assistant produces counts in the loss
(``python -m experiments.inspect_data`` shows it). Data files: JSONL, JSON, Parquet, Arrow and ``datasets``
folders, in the messages, ShareGPT or prompt/completion layouts, tokenised once and cached by content hash.
Outputs in ``--out-dir``: ``metrics.jsonl``, ``metrics.png``, ``checkpoints/`` (orbax, keep-last-N),
``summary.json``.
"""

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import tyro

from eqmoe import Transformer, presets
from eqmoe.analysis.evaluate import chat_metrics
from eqmoe.checkpoints import hf
from eqmoe.checkpoints.base import BaseModel, identify
from eqmoe.checkpoints.model_checkpoint import load_model
from eqmoe.checkpoints.run_metadata import RunMetadata
from eqmoe.config import ModelConfig
from eqmoe.config_io import config_to_dict
from eqmoe.data import (
    TRAIN_MIX,
    Conversation,
    PackedDataset,
    TaskKind,
    distinct_kinds,
    encode_chats,
    end_of_turn_ids,
    pack,
    prompt_ids,
    read_conversations,
    synthetic_split,
    tokenize_file,
)
from eqmoe.data.chat import message_text
from eqmoe.lora import LoRAConfig, add_lora, merge_lora
from eqmoe.registries import check_names
from eqmoe.train import loop
from eqmoe.train.logging import plot_metrics, write_json_atomic
from eqmoe.train.optimizer import OptimizerConfig, parameter_counts
from experiments._cli import MeshOptions, TokenizerOptions, UsageError, guarded


@dataclass(frozen=True)
class ModelOptions:
    preset: str = "qwen3-moe-micro"
    """Model preset to train from scratch (ignored with --init-from-hf)."""
    init_from_hf: Path | None = None
    """Start from this Hugging Face folder of any registered family (config.json + safetensors) instead of a preset."""
    init_from_checkpoint: Path | None = None
    """Start from this eqmoe checkpoint (experiments.convert output or another run's checkpoints folder)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype (parameters and optimizer state stay float32)."""
    remat: Literal["none", "block"] = "none"
    """Recompute each layer unit's activations in the backward pass to save memory."""
    dispatch: str | None = None
    """MoE dispatch backend: auto or one registered in eqmoe.nn.dispatch.BACKENDS (dense, sorted, ragged_dot,
    capacity); default: the model's. Like --dtype and --remat it may change on --resume."""
    lora_rank: int | None = None
    """Train LoRA adapters of this rank instead of the weights (the base stays frozen; default: no LoRA)."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: adapters are scaled by alpha / rank."""
    lora_targets: tuple[str, ...] = ("attention", "experts")
    """What gets adapters: attention, mlp, router, experts, or one matrix such as attention.q or experts.down."""
    lora_dropout: float = 0.0
    """Training-time dropout on the inputs of the attention and dense-FFN adapters (PEFT's lora_dropout)."""

    def lora(self) -> LoRAConfig | None:
        if self.lora_rank is None:
            return None
        try:
            return LoRAConfig(self.lora_rank, self.lora_alpha, self.lora_targets, self.lora_dropout)
        except ValueError as error:
            raise UsageError(f"--lora: {error}") from None


def execution_config(config: ModelConfig, options: ModelOptions) -> ModelConfig:
    """``config`` with the execution options (``--dtype``, ``--remat``, ``--dispatch``) and float32 parameters."""
    config = config.replace(dtype=options.dtype, param_dtype="float32", remat=options.remat)
    if options.dispatch is None:
        return config
    if config.moe is None:
        raise UsageError("--dispatch: the model has no MoE layers")
    try:
        config = config.replace(moe=dataclasses.replace(config.moe, dispatch=options.dispatch))
        check_names(config)  # a backend is looked up by name: refuse an unregistered one at the start
        return config
    except ValueError as error:
        raise UsageError(f"--dispatch: {error}") from None


@dataclass(frozen=True)
class DataOptions(TokenizerOptions):
    data: Path | None = None
    """Training conversations: .jsonl, .json, .parquet, .arrow or a datasets folder, in the messages, ShareGPT or
    prompt/completion layout (default: built-in tasks)."""
    eval_data: Path | None = None
    """Held-out conversations (default: every 20th conversation of --data, or the built-in eval split)."""
    data_field: str | None = None
    """The field holding each record's messages (or, in a .json object, the list of records)."""
    split: str | None = None
    """The split of a datasets or Parquet folder (default: train, or its only split)."""
    cache_dir: Path | None = None
    """Where tokenised files are cached (default: $EQMOE_CACHE, else ~/.cache/eqmoe; tokenized/ inside)."""
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


class StartingModel(NamedTuple):
    model: Transformer
    config: ModelConfig
    base: BaseModel | None  # the folder it was read from (None: a preset initialised here)


def _model_and_config(options: ModelOptions, vocab_size: int, seed: int) -> StartingModel:
    if options.init_from_hf is not None and options.init_from_checkpoint is not None:
        raise UsageError("give --init-from-hf or --init-from-checkpoint, not both")
    base = None
    if options.init_from_hf is not None or options.init_from_checkpoint is not None:
        if options.init_from_hf is not None:
            model = hf.load(options.init_from_hf)
            base = identify(options.init_from_hf)
        else:
            base = identify(options.init_from_checkpoint)
            model, _ = load_model(options.init_from_checkpoint, step=base.step, dtype="float32")
            model = merge_lora(model)  # an adapter run's result is this run's base
        config = execution_config(model.config, options)
        model = model.with_config(config)
    else:
        config = execution_config(presets.get(options.preset), options)
        model = Transformer(config, key=jax.random.key(seed))
    if vocab_size > config.vocab_size:
        raise UsageError(f"the tokenizer has {vocab_size} ids but the model's vocabulary is {config.vocab_size}")
    lora = options.lora()
    if lora is not None:
        try:
            model = add_lora(model, lora, key=jax.random.key(seed + 2))
        except ValueError as error:
            raise UsageError(f"--lora-targets: {error}") from None
    return StartingModel(model, config, base)


class ChatData(NamedTuple):
    """Training and held-out ``(ids, loss_mask)`` pairs, a few held-out conversations to answer, a note of
    what was read, and each held-out pair's task kind (built-in tasks only)."""

    train: list
    held_out: list
    sample_conversations: list[Conversation]
    note: str
    held_out_tasks: list[str] | None


def _file_data(path: Path, options: DataOptions, tokenizer, samples: int, every: int | None) -> tuple:
    """The tokenised file (every ``every``-th conversation held out when given) and held-out conversations."""
    tokenized = tokenize_file(
        path, tokenizer, field=options.data_field, split=options.split, cache_dir=options.cache_dir
    )
    pairs = list(tokenized)
    note = f"{path}: {len(pairs)} {tokenized.layout} conversations"
    if tokenized.skipped:
        note += f", {tokenized.skipped} skipped (no assistant turn)"
    note += " (tokenised before, from the cache)" if tokenized.cached else ""
    if every is None:
        return pairs, [], note, _first_conversations(path, options, samples, None)
    train = [p for i, p in enumerate(pairs) if i % every != every - 1]
    held_out = [p for i, p in enumerate(pairs) if i % every == every - 1] or pairs[:1]
    return train, held_out, note, _first_conversations(path, options, samples, every)


def _first_conversations(path: Path, options: DataOptions, count: int, every: int | None) -> list[Conversation]:
    """The first ``count`` held-out conversations (every ``every``-th with an assistant turn), read again lazily."""
    found, index = [], 0
    for item in read_conversations(path, field=options.data_field, split=options.split).items:
        if len(found) >= count:
            break
        if not item.conversation.has_reply:
            continue
        if every is None or index % every == every - 1:
            found.append(item.conversation)
        index += 1
    return found


def _chat_data(options: DataOptions, tokenizer, seed: int, samples: int) -> ChatData:
    if options.data is None:
        train = [e.messages for e in synthetic_split("train", options.train_examples, seed, options.tasks)]
        held_out_examples = synthetic_split("eval", options.eval_examples, seed, distinct_kinds(options.tasks))
        held_out = [Conversation(e.messages) for e in held_out_examples]
        encode = lambda conversations: [(e.ids, e.loss_mask) for e in encode_chats(conversations, tokenizer)]  # noqa: E731
        tasks = [e.task for e in held_out_examples]
        return ChatData(encode(train), encode(held_out), held_out, "built-in tasks", tasks)
    if options.eval_data is not None:
        train, _, note, _ = _file_data(options.data, options, tokenizer, 0, None)
        held_out, _, eval_note, conversations = _file_data(options.eval_data, options, tokenizer, samples, None)
        return ChatData(train, held_out, conversations, f"{note}; held out: {eval_note}", None)
    train, held_out, note, conversations = _file_data(options.data, options, tokenizer, samples, 20)
    return ChatData(train, held_out, conversations, note, None)


def _samples(model: Transformer, tokenizer, conversations: list[Conversation], count: int) -> list[dict[str, str]]:
    """Greedy answers to the last assistant turn of each conversation, from the template's generation prompt."""
    from eqmoe.inference import generate

    stops = end_of_turn_ids(tokenizer)
    samples = []
    for conversation in conversations[:count]:
        last = max(i for i, m in enumerate(conversation.messages) if m["role"] == "assistant")
        if last == 0:
            continue
        prompt = prompt_ids(Conversation(conversation.messages[:last], conversation.tools), tokenizer)
        output = generate(
            model, jnp.asarray(prompt)[None], max_new_tokens=32, eos_id=stops or None, vocab_limit=tokenizer.vocab_size
        )
        new = [int(t) for t in np.asarray(output[0, len(prompt) :])]
        stop = next((i for i, token in enumerate(new) if token in stops), len(new))
        asked = next((m for m in reversed(conversation.messages[:last]) if m["role"] != "assistant"), {})
        samples.append(
            {
                "prompt": message_text(asked.get("content")),
                "expected": message_text(conversation.messages[last].get("content")),
                "generated": tokenizer.decode(new[:stop]),
            }
        )
    return samples


def run(args: Args) -> dict:
    """Train, evaluate and write every output; returns the summary."""
    run_options, out_dir = args.run, args.run.out_dir
    run_options.check()
    parallelism = args.parallel.build()
    tokenizer = args.data.load()
    model, config, base = _model_and_config(args.model, tokenizer.vocab_size, run_options.seed)
    data = _chat_data(args.data, tokenizer, run_options.seed, run_options.samples)
    seq_len = args.data.seq_len
    packed = pack(data.train, seq_len, tokenizer.pad_id, overflow="truncate")
    eval_rows = pack(data.held_out, seq_len, tokenizer.pad_id, overflow="truncate").rows
    if not packed.rows.loss_mask.any():
        raise UsageError(
            f"--seq-len {seq_len}: no training token left: all {packed.too_long} truncated conversations lose every "
            "answer token; raise --seq-len"
        )
    dataset = PackedDataset(packed.rows)
    print(
        f"data: {data.note}; {packed.num_conversations} packed into {len(dataset)} rows of {seq_len} "
        f"({packed.fill:.0%} filled, {packed.too_long} truncated); {len(data.held_out)} held out; "
        f"template: {tokenizer.chat_template.origin}",
        file=sys.stderr,
    )

    tokenizer_path = None if args.data.tokenizer is None else str(args.data.tokenizer.absolute())
    result = loop.train(
        model,
        args.optim,
        run_options,
        dataset=dataset,
        batch_size=args.data.batch_size,
        evaluate=lambda model: chat_metrics(model, eval_rows, args.data.batch_size),
        metadata=RunMetadata(
            config,
            tokenizer=tokenizer_path,
            bytes_tokenizer=tokenizer_path is None,
            chat_template=None if args.data.chat_template is None else str(args.data.chat_template.absolute()),
            template_vars=tokenizer.chat_template.variables,
            lora=None if args.model.lora() is None else dataclasses.asdict(args.model.lora()),
            base=base,
        ),
        parallelism=parallelism,
        arguments=dataclasses.asdict(args),
    )
    model = result.state.model
    if jax.process_index() == 0:
        plot_metrics(result.metrics.records(), out_dir / "metrics.png")
    samples = _samples(model, tokenizer, data.sample_conversations, run_options.samples)
    by_task = {}
    for task in sorted(set(data.held_out_tasks or ())):
        pairs = [p for p, t in zip(data.held_out, data.held_out_tasks, strict=True) if t == task]
        rows = pack(pairs, seq_len, tokenizer.pad_id, overflow="truncate").rows
        by_task[task] = chat_metrics(model, rows, args.data.batch_size)["eval_accuracy"]
    summary = {
        "final_loss": result.last_terms.get("loss", float("nan")),
        "eval_loss": result.final_eval["eval_loss"],
        "eval_accuracy": result.final_eval["eval_accuracy"],
        "eval_accuracy_by_task": by_task,
        "steps": run_options.steps,
        "tokens_per_second": result.tokens_per_second,
        "compile_seconds": result.compile_seconds,
        "held_out_conversations": len(data.held_out),
        "parameters": parameter_counts(model, args.optim),
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
    counts = summary["parameters"]
    print(f"parameters: {counts['trainable']:,} trainable of {counts['total']:,} ({counts['trainable_fraction']:.3%})")
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
