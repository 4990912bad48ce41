"""Next-token pretraining of any preset on packed text, with routing statistics per layer and domain.

    python -m experiments.pretrain                                  # qwen3-moe-micro on the built-in corpus
    python -m experiments.pretrain --override moe.router.top_k=1 moe.router.renormalize=false
    python -m experiments.pretrain --data notes.txt corpus.jsonl --tokenizer tokenizer.json
    python -m experiments.pretrain --dispatch ragged_dot            # the MoE dispatch backend, as in sft
    python -m experiments.pretrain --steps 2000 --resume            # continue the run in --out-dir
    python -m experiments.pretrain --init-from-hf DIR --import my_router --override moe.router.strategy=mine

The built-in data is a deterministic multi-domain corpus (arithmetic, a small grammar, copy/reverse
strings, Python standard library source; see ``eqmoe.data.corpus``), so it is measurable whether
experts specialise by domain. ``--override FIELD.PATH=VALUE`` changes any model config field of the
preset (the value is JSON, or bare text). ``--init-from-hf`` / ``--init-from-checkpoint`` start from a saved
model instead; overrides then may change what keeps every parameter as it is (routing, loss, execution),
and one that would add, drop or reshape one is refused. ``--import MODULE`` imports a module first, so the
parts it registers (``eqmoe.registries``: a router strategy, a dispatch backend...) can be named in overrides.
A single text file is one document: its last twentieth is the held-out text.

Outputs in ``--out-dir``: ``metrics.jsonl`` (training terms every ``--log-every`` steps; eval loss and
routing statistics every ``--eval-every`` steps), ``metrics.png``, ``routing.png`` (which experts each
domain's tokens chose, per layer), ``checkpoints/`` and ``summary.json``.
"""

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import tyro

from eqmoe import Transformer, parallel, presets
from eqmoe.analysis.evaluate import plot_domain_routing, routing_metrics
from eqmoe.checkpoints.orbax import Checkpointer
from eqmoe.checkpoints.run_metadata import RunMetadata
from eqmoe.checkpoints.source import ModelSource, folder_tokenizer
from eqmoe.config import ModelConfig
from eqmoe.config_io import apply_overrides, architecture_differences, config_to_dict, format_override, parse_override
from eqmoe.data import ByteTokenizer, PackedDataset, load_tokenizer
from eqmoe.data.corpus import (
    EVAL_CHARS_PER_DOMAIN,
    Document,
    load_documents,
    pack_documents,
    split_documents,
    synthetic_documents,
)
from eqmoe.data.hub import resolve_folder
from eqmoe.registries import check_names
from eqmoe.train import loop
from eqmoe.train.logging import plot_metrics, write_json_atomic
from eqmoe.train.optimizer import OptimizerConfig
from experiments._cli import UsageError, check_vocabulary, guarded, replay_stored_arguments
from experiments.evaluate import check_eval_tasks, evaluate_model, print_lm_eval
from experiments.options import (
    DispatchOption,
    EvalOptions,
    MeshOptions,
    ShapeOptions,
    StartOptions,
    TokenizerOption,
    import_modules,
)


@dataclass(frozen=True)
class ModelOptions(DispatchOption, StartOptions):
    changeable_on_resume: ClassVar[frozenset[str]] = StartOptions.changeable_on_resume | {"dispatch"}


@dataclass(frozen=True)
class DataOptions(TokenizerOption, ShapeOptions):
    data: tuple[Path, ...] = ()
    """Text files (one document each) or JSONL files of {"text", "domain"} (default: the built-in corpus)."""
    chars_per_domain: int = 400_000
    """Built-in corpus: training characters of each domain."""
    eval_chars_per_domain: int = EVAL_CHARS_PER_DOMAIN
    """Built-in corpus: held-out characters of each domain."""


@dataclass(frozen=True)
class RunOptions(loop.RunOptions):
    steps: int = 600
    """Total optimizer steps of the run (a resumed run continues up to this)."""
    out_dir: Path = Path("runs/pretrain")
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
    eval: EvalOptions = EvalOptions()


def _loaded_from(options: ModelOptions) -> str | None:
    """The flag naming the model the run starts from, or ``None`` for a preset initialised here."""
    if options.init_from_hf is not None and options.init_from_checkpoint is not None:
        raise UsageError("give --init-from-hf or --init-from-checkpoint, not both")
    if options.init_from_hf is not None:
        return f"--init-from-hf {options.init_from_hf}"
    if options.init_from_checkpoint is not None:
        return f"--init-from-checkpoint {options.init_from_checkpoint}"
    return None


def _checkpoint_folder(path: Path) -> Path:
    """``path``, or the ``checkpoints`` folder inside it when it is a run's output folder."""
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: checkpoint folder not found")
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def _tokenizer(args: Args):
    """``--tokenizer``, else the starting model's own (:func:`eqmoe.checkpoints.source.folder_tokenizer`, as sft and
    generate find it: its folder's file, or the one its run recorded), else eqmoe's byte tokenizer."""
    options = args.model
    if args.data.tokenizer is not None or _loaded_from(options) is None:
        return load_tokenizer(args.data.tokenizer)
    if options.init_from_hf is not None:
        folder, recorded = resolve_folder(options.init_from_hf), None
    else:
        folder = _checkpoint_folder(options.init_from_checkpoint)
        with Checkpointer(folder, keep_last=None) as checkpointer:
            recorded = RunMetadata.from_json(checkpointer.metadata(), str(folder))
    return folder_tokenizer(folder, recorded, chat=False, bytes_if_none=True)


def start_config(options: ModelOptions) -> ModelConfig:
    """The config before ``--override``: the preset's or the saved model's (read without its weights), with the
    dtype and remat options and float32 parameters."""
    from eqmoe.checkpoints import hf

    _loaded_from(options)
    if options.init_from_hf is not None:
        config = hf.read_config(options.init_from_hf)
    elif options.init_from_checkpoint is not None:
        folder = _checkpoint_folder(options.init_from_checkpoint)
        with Checkpointer(folder, keep_last=None) as checkpointer:
            config = RunMetadata.from_json(checkpointer.metadata(), str(folder)).config
        try:
            check_names(config)  # the model is built to be loaded, whatever the overrides change
        except ValueError as error:
            raise UsageError(
                f"{folder}: {error} (the run that saved it imported the part: --import its module)"
            ) from None
    else:
        config = presets.get(options.preset)
    return options.execution(config)


def _parameter_shapes(config: ModelConfig) -> list:
    """Every array of a model of ``config``, by path (traced, nothing allocated)."""
    abstract = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
    leaves = jax.tree_util.tree_leaves_with_path(abstract)
    return [(jax.tree_util.keystr(path), jnp.shape(leaf)) for path, leaf in leaves]


def _as_override(path: str, value: object) -> str:
    try:
        return format_override(path, value)
    except TypeError:  # not JSON (the LayerKind objects of layers)
        return f"{path}={value!r}"


def _check_same_parameters(start: ModelConfig, config: ModelConfig, loaded_from: str) -> None:
    """A loaded model's parameters must fit ``config``: a ``UsageError`` naming the override that would add, drop
    or reshape one."""
    differences = architecture_differences(start, config)
    if not differences or _parameter_shapes(start) == _parameter_shapes(config):
        return
    culprits = []
    for path, _, new in differences:
        try:
            alone = apply_overrides(start, {path: new})
        except ValueError:  # valid only together with another change: cannot be told apart
            continue
        if _parameter_shapes(alone) != _parameter_shapes(start):
            culprits.append(_as_override(path, new))
    changed = ", ".join(culprits or [_as_override(path, new) for path, _, new in differences])
    raise UsageError(
        f"{changed} would change the parameters of the model from {loaded_from}; a loaded model takes only "
        "changes that keep every parameter as it is (routing, loss, execution)"
    )


def model_config(options: ModelOptions, start: ModelConfig | None = None) -> ModelConfig:
    """The starting config (:func:`start_config`, or ``start`` when given) with ``--override`` applied; a loaded
    model's parameter shapes must stay as they are."""
    start = start_config(options) if start is None else start
    config = options.with_dispatch(apply_overrides(start, dict(parse_override(text) for text in options.override)))
    loaded_from = _loaded_from(options)
    if loaded_from is not None:
        _check_same_parameters(start, config, loaded_from)
    return config


def starting_model(options: ModelOptions, config: ModelConfig, seed: int) -> Transformer:
    """The preset initialised with ``seed``, or the saved model's float32 weights under ``config``."""
    from eqmoe.checkpoints import hf
    from eqmoe.checkpoints.model_checkpoint import load_model
    from eqmoe.lora import merge_lora

    if _loaded_from(options) is None:
        return parallel.drawn_on_host(lambda: Transformer(config, key=jax.random.key(seed)))
    if options.init_from_hf is not None:
        model = hf.load(options.init_from_hf, dtype="float32")
    else:
        folder = _checkpoint_folder(options.init_from_checkpoint)
        model = merge_lora(load_model(folder, dtype="float32")[0])  # a LoRA run's adapters are part of its model
    # model_config has checked that these keep every parameter as it is (routing, attention.qk_norm, ...).
    allow = tuple(path for path, *_ in architecture_differences(model.config, config))
    return model.with_config(config, allow=allow)


def _hold_out_tail(document: Document) -> tuple[list[Document], list[Document]]:
    """A lone document's last twentieth (from a line start, when there is one) as the held-out text."""
    text = document.text
    mark = len(text) * 19 // 20
    line = text.find("\n", mark) + 1
    cut = line if 0 < line < len(text) else mark
    return [Document(text[:cut], document.domain)], [Document(text[cut:], document.domain)]


def _documents(options: DataOptions, seed: int):
    if not options.data:
        train = synthetic_documents("train", options.chars_per_domain, seed)
        return train, synthetic_documents("eval", options.eval_chars_per_domain, seed), "built-in corpus"
    documents = load_documents(options.data)
    train, held_out = split_documents(documents)
    note = f"{len(documents)} documents from {len(options.data)} file(s)"
    if not held_out:
        train, held_out = _hold_out_tail(documents[0])
        note = f"one document from {options.data[0]}, its last twentieth held out"
    return train, held_out, note


def run(args: Args) -> dict:
    """Train, evaluate and write every output; returns the summary."""
    options, out_dir = args.run, args.run.out_dir
    options.check()
    parallelism = args.parallel.build()  # first: claiming the folder asks which process this is
    options.claim_out_dir()
    import_modules(args.model.import_modules)
    check_eval_tasks(args.eval, args.eval.eval_tasks)  # a bad task name fails before training, not after
    try:
        config = model_config(args.model)
    except ValueError as error:
        raise UsageError(str(error)) from None
    tokenizer = _tokenizer(args)
    check_vocabulary(tokenizer.vocab_size, config.vocab_size, from_checkpoint=_loaded_from(args.model) is not None)
    train_docs, held_out_docs, note = _documents(args.data, options.seed)
    train = pack_documents(train_docs, tokenizer, args.data.seq_len)
    held_out = pack_documents(held_out_docs, tokenizer, args.data.seq_len, domains=train.domains)
    dataset = PackedDataset(train.packed.rows)
    print(
        f"data: {note}; domains {', '.join(train.domains)}; {len(dataset)} training rows of {args.data.seq_len} "
        f"({train.packed.fill:.0%} filled), {len(held_out.packed.rows.tokens)} held-out rows",
        file=sys.stderr,
    )

    def held_out_metrics(model):
        rows, labels = held_out.packed.rows, held_out.packed.labels
        return routing_metrics(model, rows, labels, len(train.domains), args.data.batch_size)

    model = starting_model(args.model, config, options.seed)
    # what generate, convert and analyze_routing decode the run's text with
    metadata = RunMetadata(
        config,
        tokenizer=None if isinstance(tokenizer, ByteTokenizer) else str(Path(tokenizer.path).absolute()),
        bytes_tokenizer=isinstance(tokenizer, ByteTokenizer),
    )
    result = loop.train(
        model,
        args.optim,
        options,
        dataset=dataset,
        batch_size=args.data.batch_size,
        evaluate=held_out_metrics,
        metadata=metadata,
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
    if args.eval.eval_tasks:  # the final model with the tokenizer the run recorded
        source = ModelSource(result.state.model, out_dir / "checkpoints", metadata)
        summary["lm_eval"] = evaluate_model(args.eval, args.eval.eval_tasks, source, parallelism)
    if jax.process_index() == 0:
        write_json_atomic(out_dir / "summary.json", summary)
    return summary


def main(args: Args) -> int:
    summary = guarded("pretrain", lambda args: run(replay_stored_arguments(args, Args())), args)
    if summary is None:
        return 2
    line = f"final loss {summary['final_loss']:.4f}  eval loss {summary['eval_loss']:.4f}"
    if "eval_load_cv" in summary:
        line += (
            f"  load CV {summary['eval_load_cv']:.3f}  dropped {summary['eval_dropped_fraction']:.3f}"
            f"  domain NMI {summary['eval_domain_nmi']:.3f}"
        )
    print(f"{line}  ({summary['tokens_per_second'] or 0:,.0f} tok/s)")
    print_lm_eval(summary.get("lm_eval"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args, config=(tyro.conf.OmitArgPrefixes,))))
