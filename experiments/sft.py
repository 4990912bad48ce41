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
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import tyro

from eqmoe import Transformer, parallel, presets
from eqmoe.analysis.evaluate import chat_metrics
from eqmoe.checkpoints import hf, quantized
from eqmoe.checkpoints.base import BaseModel, identify
from eqmoe.checkpoints.model_checkpoint import load_model
from eqmoe.checkpoints.run_metadata import RunMetadata
from eqmoe.checkpoints.source import ModelSource, source_tokenizer
from eqmoe.config import ModelConfig
from eqmoe.config_io import apply_overrides, config_to_dict, parse_override
from eqmoe.data import (
    TRAIN_MIX,
    ByteTokenizer,
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
from eqmoe.data.hub import resolve_folder
from eqmoe.lora import add_lora, merge_lora
from eqmoe.nn.fp8 import held_bytes
from eqmoe.train import loop
from eqmoe.train.logging import plot_metrics, write_json_atomic
from eqmoe.train.optimizer import OptimizerConfig, parameter_counts
from experiments._cli import UsageError, check_vocabulary, guarded, replay_stored_arguments
from experiments.evaluate import check_eval_tasks, evaluate_model, print_lm_eval
from experiments.options import (
    DispatchOption,
    EvalOptions,
    LoRAOptions,
    MeshOptions,
    ShapeOptions,
    StartOptions,
    TokenizerOptions,
    import_modules,
)


@dataclass(frozen=True)
class ModelOptions(LoRAOptions, DispatchOption, StartOptions):
    # --fp8-base changes how the frozen base is held, not what is trained: the checkpoints hold the adapters alone
    changeable_on_resume: ClassVar[frozenset[str]] = StartOptions.changeable_on_resume | {"dispatch", "fp8_base"}


def execution_config(config: ModelConfig, options: ModelOptions) -> ModelConfig:
    """``config`` with ``--override`` and the execution options (``--dtype``, ``--remat``, ``--dispatch``) and
    float32 parameters."""
    try:
        config = apply_overrides(config, dict(parse_override(text) for text in options.override))
    except ValueError as error:
        raise UsageError(f"--override: {error}") from None
    return options.with_dispatch(options.execution(config))


@dataclass(frozen=True)
class DataOptions(ShapeOptions, TokenizerOptions):
    changeable_on_resume: ClassVar[frozenset[str]] = frozenset({"cache_dir"})

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
    train_examples: int = 50_000
    """Built-in tasks: training conversations to generate."""
    eval_examples: int = 500
    """Built-in tasks: held-out conversations to generate."""
    tasks: tuple[TaskKind, ...] = TRAIN_MIX
    """Built-in tasks: the training cycle of task kinds (a kind listed twice is drawn twice as often); the
    held-out conversations cycle through each listed kind once."""


@dataclass(frozen=True)
class RunOptions(loop.RunOptions):
    changeable_on_resume: ClassVar[frozenset[str]] = loop.RunOptions.changeable_on_resume | {"samples"}

    steps: int = 1600
    """Total optimizer steps of the run (a resumed run continues up to this)."""
    out_dir: Path = Path("runs/sft")
    samples: int = 4
    """Held-out prompts to answer with greedy generation at the end."""
    epochs: float | None = None
    """Train this many passes over the training rows instead of --steps (the steps it makes are reported)."""


@dataclass(frozen=True)
class Args:
    model: ModelOptions = ModelOptions()
    data: DataOptions = DataOptions()
    optim: OptimizerConfig = OptimizerConfig(
        learning_rate=None, warmup_steps=100, decay_steps="steps", weight_decay=0.1
    )
    run: RunOptions = RunOptions()
    parallel: MeshOptions = MeshOptions()
    eval: EvalOptions = EvalOptions()


class StartingModel(NamedTuple):
    model: Transformer
    config: ModelConfig
    base: BaseModel | None  # the folder it was read from (None: a preset initialised here)
    source: ModelSource | None  # where its tokenizer and chat template are found (None: a preset)


def _model_and_config(options: ModelOptions, seed: int, parallelism=None) -> StartingModel:
    if options.init_from_hf is not None and options.init_from_checkpoint is not None:
        raise UsageError("give --init-from-hf or --init-from-checkpoint, not both")
    if options.fp8_base:
        options.lora()  # refuses --fp8-base without --lora-rank
        if options.init_from_hf is None:
            raise UsageError("--fp8-base: give --init-from-hf with a block-FP8 folder (DeepSeek-V3's published files)")
    base = source = None
    if options.init_from_hf is not None or options.init_from_checkpoint is not None:
        if options.init_from_hf is not None:
            folder = resolve_folder(options.init_from_hf)  # a Hub id: its snapshot in the Hugging Face cache
            if options.fp8_base and quantized.read_scheme(folder) is None:
                raise UsageError(
                    f"--fp8-base: {folder} is not block-FP8 (its config.json has no fp8 quantization_config)"
                )
            # float32 master weights (--fp8-base: the quantized ones as stored); on a mesh each tensor goes straight
            # to its shards
            model = hf.load(folder, dtype="float32", parallelism=parallelism, keep_fp8=options.fp8_base)
            if options.fp8_base:
                _report_fp8(model)
            base = identify(folder)
            source = ModelSource(model, base.path, None)
        else:
            base = identify(options.init_from_checkpoint)
            model, metadata = load_model(options.init_from_checkpoint, step=base.step, dtype="float32")
            model = merge_lora(model)  # an adapter run's result is this run's base
            source = ModelSource(model, base.path, metadata)
        config = execution_config(model.config, options)
        model = model.with_config(config)
    else:
        config = execution_config(presets.get(options.preset), options)
        model = parallel.drawn_on_host(lambda: Transformer(config, key=jax.random.key(seed)))
    return StartingModel(model, config, base, source)


def _report_fp8(model: Transformer) -> None:
    """One line on stderr: how much of the base is held in block-FP8 and at how many bytes per parameter."""
    count, size = held_bytes(model)
    print(
        f"--fp8-base: {count:,} base parameters held in block-FP8, {size / 2**20:,.1f} MiB with their scales "
        f"({size / max(count, 1):.3f} bytes/parameter); dequantized layer by layer inside each step",
        file=sys.stderr,
    )


def _with_adapters(model: Transformer, options: ModelOptions, seed: int) -> Transformer:
    lora = options.lora()
    if lora is None:
        return model
    try:
        return add_lora(model, lora, key=jax.random.key(seed + 2))
    except ValueError as error:
        raise UsageError(f"--lora-targets: {error}") from None


def _tokenizer(options: DataOptions, starting: StartingModel):
    """``--tokenizer``, else the starting model's own (its folder's, or the one its run recorded), else bytes for
    a preset; refused in one line when its vocabulary does not fit the model's. With where it came from."""
    variables = options.variables()
    if starting.source is None or options.tokenizer is not None:
        tokenizer, origin = options.load(), "--tokenizer" if options.tokenizer is not None else "built-in bytes"
    else:
        tokenizer = source_tokenizer(
            starting.source, chat_template=options.chat_template, template_vars=variables, bytes_if_none=True
        )
        origin = "the starting model's"
        if isinstance(tokenizer, ByteTokenizer):  # a byte-level model, or a folder without its tokenizer: checked below
            origin = "built-in bytes: the starting model's folder names no tokenizer"
    check_vocabulary(tokenizer.vocab_size, starting.config.vocab_size, from_checkpoint=starting.source is not None)
    return tokenizer, origin


# Peak learning rates by where the run starts: the from-scratch rate would wreck a trained model; LoRA's
# adapters start at zero and take a larger rate than full fine-tuning.
LEARNING_RATES = {"from scratch": 3e-3, "LoRA fine-tuning": 2e-4, "full fine-tuning": 2e-5}


def _optimizer(args: Args, starting: StartingModel) -> OptimizerConfig:
    """``--learning-rate`` or the default for how the run starts; the cosine ends at ``--steps`` unless told."""
    kind = (
        "from scratch"
        if starting.source is None
        else "LoRA fine-tuning"
        if args.model.lora_rank
        else "full fine-tuning"
    )
    optim = args.optim.for_run(args.run.steps, LEARNING_RATES[kind])
    origin = "--learning-rate" if args.optim.learning_rate is not None else f"the {kind} default"
    decay = (
        "constant" if optim.decay_steps is None else f"cosine to {optim.final_lr_ratio:g}x at step {optim.decay_steps}"
    )
    print(
        f"optimizer: peak learning rate {optim.learning_rate:g} ({origin}), warmup {optim.warmup_steps} steps, {decay}",
        file=sys.stderr,
    )
    return optim


def _recorded_template(options: DataOptions, starting: StartingModel) -> str | None:
    """The chat template file this run renders with, to record: ``--chat-template``, else the one the starting
    checkpoint's run recorded (None: the tokenizer folder's own)."""
    if options.chat_template is not None:
        return str(options.chat_template.absolute())
    recorded = starting.source.metadata if starting.source is not None and options.tokenizer is None else None
    return recorded.chat_template if recorded is not None else None


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
    """Greedy answers to the last assistant turn of each conversation, from the template's generation prompt; the
    prompts left-padded into one batch, so one program is compiled rather than one per prompt length."""
    from eqmoe.inference import generate

    stops = end_of_turn_ids(tokenizer)
    asked, expected, prompts = [], [], []
    for conversation in conversations[:count]:
        last = max(i for i, m in enumerate(conversation.messages) if m["role"] == "assistant")
        if last == 0:
            continue
        prompts.append(prompt_ids(Conversation(conversation.messages[:last], conversation.tools), tokenizer))
        question = next((m for m in reversed(conversation.messages[:last]) if m["role"] != "assistant"), {})
        asked.append(message_text(question.get("content")))
        expected.append(message_text(conversation.messages[last].get("content")))
    if not prompts:
        return []
    width = max(len(prompt) for prompt in prompts)
    batch = np.full((len(prompts), width), tokenizer.pad_id, np.int32)
    for row, prompt in zip(batch, prompts, strict=True):
        row[width - len(prompt) :] = prompt
    mask = np.arange(width)[None] >= width - np.array([len(prompt) for prompt in prompts])[:, None]
    output = generate(
        model,
        jnp.asarray(batch),
        prompt_mask=jnp.asarray(mask),
        max_new_tokens=32,
        eos_id=stops or None,
        vocab_limit=tokenizer.vocab_size,
    )
    samples = []
    for new, question, answer in zip(np.asarray(output[:, width:]).tolist(), asked, expected, strict=True):
        stop = next((i for i, token in enumerate(new) if token in stops), len(new))
        samples.append({"prompt": question, "expected": answer, "generated": tokenizer.decode(new[:stop])})
    return samples


def run(args: Args) -> dict:
    """Train, evaluate and write every output; returns the summary."""
    run_options, out_dir = args.run, args.run.out_dir
    run_options.check()
    parallelism = args.parallel.build()  # first: claiming the folder asks which process this is
    run_options.claim_out_dir()
    import_modules(args.model.import_modules)
    check_eval_tasks(args.eval, args.eval.eval_tasks)  # a bad task name fails before training, not after
    starting = _model_and_config(args.model, run_options.seed, parallelism)
    tokenizer, tokenizer_origin = _tokenizer(args.data, starting)
    model, config, base = _with_adapters(starting.model, args.model, run_options.seed), starting.config, starting.base
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
    if run_options.epochs is not None:
        if run_options.epochs <= 0:
            raise UsageError(f"--epochs {run_options.epochs:g} is invalid; allowed: a positive number")
        steps = max(1, math.ceil(run_options.epochs * len(dataset) / (args.data.batch_size * run_options.grad_accum)))
        run_options = dataclasses.replace(run_options, steps=steps)
        args = dataclasses.replace(args, run=run_options)
        print(f"--epochs {run_options.epochs:g}: {steps} steps over {len(dataset)} rows", file=sys.stderr)
    if packed.too_long:
        longest = max(len(ids) for ids, _ in data.train)
        print(
            f"warning: {packed.too_long} of {packed.num_conversations} training conversations "
            f"({packed.too_long / packed.num_conversations:.1%}) are longer than --seq-len {seq_len} and are cut "
            f"(the longest has {longest} tokens)",
            file=sys.stderr,
        )
    print(
        f"data: {data.note}; {packed.num_conversations} packed into {len(dataset)} rows of {seq_len} "
        f"({packed.fill:.0%} filled, {packed.too_long} truncated); {len(data.held_out)} held out; "
        f"tokenizer: {tokenizer!r} ({tokenizer_origin}); template: {tokenizer.chat_template.origin}",
        file=sys.stderr,
    )

    tokenizer_path = None if isinstance(tokenizer, ByteTokenizer) else str(Path(tokenizer.path).absolute())
    optim = _optimizer(args, starting)
    metadata = RunMetadata(
        config,
        tokenizer=tokenizer_path,
        bytes_tokenizer=tokenizer_path is None,
        chat_template=_recorded_template(args.data, starting),
        template_vars=tokenizer.chat_template.variables,
        lora=None if args.model.lora() is None else dataclasses.asdict(args.model.lora()),
        base=base,
    )
    result = loop.train(
        model,
        optim,
        run_options,
        dataset=dataset,
        batch_size=args.data.batch_size,
        evaluate=lambda model: chat_metrics(model, eval_rows, args.data.batch_size),
        metadata=metadata,
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
        "parameters": parameter_counts(model, optim),
        "samples": samples,
        "config": config_to_dict(config),
        "args": dataclasses.asdict(args),
    }
    if args.eval.eval_tasks:  # the final model with the tokenizer (and template) the run recorded
        source = ModelSource(model, out_dir / "checkpoints", metadata)
        summary["lm_eval"] = evaluate_model(args.eval, args.eval.eval_tasks, source, parallelism)
    if jax.process_index() == 0:
        write_json_atomic(out_dir / "summary.json", summary)
    return summary


def main(args: Args) -> int:
    summary = guarded("sft", lambda args: run(replay_stored_arguments(args, Args())), args)
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
    print_lm_eval(summary.get("lm_eval"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args, config=(tyro.conf.OmitArgPrefixes,))))
