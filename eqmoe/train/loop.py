"""The training loop every experiment shares: resume, train, log, evaluate, checkpoint.

A run is reproducible from its options alone: the data order depends only on the seed and the
checkpointed ``data_step``, so a run stopped anywhere and resumed from its last checkpoint takes
exactly the steps an uninterrupted run takes.
"""

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import equinox as eqx
import jax
import numpy as np

from eqmoe import parallel
from eqmoe.checkpoints.base import BaseModel
from eqmoe.checkpoints.model_checkpoint import changed_part, restore
from eqmoe.checkpoints.orbax import Checkpointer
from eqmoe.checkpoints.run_metadata import RunMetadata
from eqmoe.config_io import architecture_differences, config_to_dict, format_differences
from eqmoe.data import PackedDataset
from eqmoe.model import Transformer
from eqmoe.train.logging import MetricsLog, Progress, plot_metrics
from eqmoe.train.optimizer import OptimizerConfig, make_optimizer, trained_roles
from eqmoe.train.state import TrainState, abstract_state, hold_frozen, init_state
from eqmoe.train.step import device_batch, make_train_step
from eqmoe.train.tracking import TrackerName, Trackers, start_trackers


@dataclass(frozen=True)
class RunOptions:
    steps: int = 1600
    """Total optimizer steps of the run (a resumed run continues up to this)."""
    out_dir: Path = Path("runs/train")
    """Where metrics, plots, checkpoints and the summary go."""
    resume: bool = False
    """Continue from the latest checkpoint in --out-dir."""
    checkpoint_every: int = 400
    """Save a checkpoint every N steps (and at the end)."""
    keep_checkpoints: int = 2
    """How many checkpoints to keep."""
    eval_every: int = 400
    """Evaluate on the held-out set every N steps (and at the end)."""
    log_every: int = 50
    """Write a metrics.jsonl line and update the progress display every N steps."""
    seed: int = 0
    """Seed for the parameters, the built-in data and the data order."""
    tracker: tuple[TrackerName, ...] = ("jsonl",)
    """Where metrics go besides metrics.jsonl (always written): tensorboard (event files in OUT_DIR/tensorboard),
    wandb (W&B; WANDB_MODE=offline works without a network)."""
    wandb_project: str = "eqmoe"
    """W&B project of --tracker wandb."""

    def check(self) -> None:
        """A ``ValueError`` naming the first option that is not a positive number."""
        for name in ("steps", "checkpoint_every", "keep_checkpoints", "eval_every", "log_every"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"--{name.replace('_', '-')}={value} is invalid; allowed: a positive number")


class TrainResult(NamedTuple):
    state: TrainState
    metrics: MetricsLog
    last_terms: dict[str, float]  # the last logged training terms
    final_eval: dict[str, object]  # the last evaluation: numbers, and whatever else evaluate returns
    tokens_per_second: float | None  # median over the logged windows (the first, compiling step excluded)
    compile_seconds: float | None  # the first step of this process, compilation included


def train(
    model: Transformer,
    optimizer_config: OptimizerConfig,
    options: RunOptions,
    *,
    dataset: PackedDataset,
    batch_size: int,
    evaluate: Callable[[Transformer], dict[str, float]],
    metadata: RunMetadata,
    parallelism: parallel.Parallelism | None = None,
    arguments: dict | None = None,
) -> TrainResult:
    """Train ``model`` for ``options.steps`` steps (from the latest checkpoint with ``options.resume``).

    **Arguments:**

    - ``dataset``, ``batch_size``: batch ``n`` is ``dataset.batch_at(n, batch_size, options.seed)``; each
      process reads its own slice of it.
    - ``evaluate(model)``: held-out metrics, written to ``metrics.jsonl`` every ``eval_every`` steps and
      at the end (called with ``parallelism`` active); the last one is also returned as ``final_eval``.
    - ``metadata``: the :class:`RunMetadata` stored with every checkpoint (its step, data step, seed and model
      config filled in at each save).
    - ``arguments``: the experiment's command-line arguments, for the trackers' run config (with the model,
      optimizer and run options).
    - ``parallelism``: a device mesh (:mod:`eqmoe.parallel`); the model, optimizer state and batches are
      sharded by its rules and checkpoints restore onto it whatever mesh saved them.

    Raises ``FloatingPointError`` naming the step and the non-finite terms (the last checkpoint is kept),
    and ``ValueError`` naming the differing fields when resuming a run of a different architecture
    (:func:`eqmoe.config_io.architecture_differences`); other config changes (remat, dispatch, dtype, loss
    weights) apply from the resumed step on.
    """
    with parallel.activate(parallelism):
        return _train(model, optimizer_config, options, dataset, batch_size, evaluate, metadata, parallelism, arguments)


def _check_same_base(stored: BaseModel | None, now: BaseModel | None, out_dir: Path) -> None:
    """A resumed run must start from the base model its checkpoints were trained on."""
    if stored is None or (now is not None and now.sha256 == stored.sha256):
        return
    if now is None:
        raise ValueError(
            f"--resume: the checkpoint in {out_dir} was trained on the base model {stored.path}; start from it"
        )
    raise ValueError(
        f"--resume: the checkpoint in {out_dir} was trained on the base model {stored.path} "
        f"(content sha256 {stored.sha256[:16]}), not on {now.path} ({now.sha256[:16]})"
    )


def _int(value) -> int:
    return int(parallel.to_host(value))


def _train(
    model, optimizer_config, options, dataset, batch_size, evaluate, metadata, parallelism, arguments
) -> TrainResult:
    options.check()
    config, out_dir = model.config, options.out_dir
    params = eqx.filter(model, eqx.is_array)
    optimizer, schedule = make_optimizer(optimizer_config, params, embed_dim=config.embed_dim)
    trained = trained_roles(optimizer_config, params)
    model = hold_frozen(model, trained)
    key = jax.random.key(options.seed + 1)
    checkpointer = Checkpointer(out_dir / "checkpoints", keep_last=options.keep_checkpoints)
    latest = checkpointer.latest_step() if options.resume else None
    if options.resume and latest is None:
        print(f"--resume: no checkpoint in {out_dir / 'checkpoints'}; starting from step 0", file=sys.stderr)
    if latest is not None:
        # Only the architecture must match: the execution and objective fields of the new config apply
        # from here on (the restore target is built from the new model, so the restored model carries
        # its config, and the next checkpoints store it).
        stored = RunMetadata.from_json(checkpointer.metadata(latest), str(out_dir / "checkpoints"))
        differences = architecture_differences(stored.config, config)
        if differences:
            checkpointer.close()
            raise ValueError(
                f"--resume: the checkpoint in {out_dir} has a different architecture: "
                + format_differences(differences, "checkpoint", "now")
            )
        _check_same_base(stored.base, metadata.base, out_dir)
        target = abstract_state(lambda: model, optimizer, key=key)
        if parallelism is not None:
            target = parallel.abstract_sharded(target, parallelism)
        # Leaves a checkpoint of a run with a base folder leaves out (frozen weights) come from the base.
        fill = eqx.tree_at(lambda s: s.model, target, parallel.shard(model, parallelism))
        state = restore(checkpointer, latest, target, fill=fill)
        state = eqx.tree_at(lambda s: s.model, state, hold_frozen(state.model, trained))
        assert state.model.config == config, "the restored model must carry the new config"
        print(f"resumed from step {latest}", file=sys.stderr)
    else:
        state = init_state(model, optimizer, key=key, parallelism=parallelism)
    del model
    start = _int(state.step)
    primary = jax.process_index() == 0
    resumed_at = start if latest is not None else None
    run_config = {"model": config_to_dict(config), "optimizer": asdict(optimizer_config), "run": asdict(options)}
    run_config.update(arguments=arguments or {}, metadata=metadata.replace(config=config).to_json())
    try:
        trackers = Trackers([])
        if primary:
            trackers = start_trackers(
                options.tracker, out_dir, run_config, resumed_at=resumed_at, wandb_project=options.wandb_project
            )
    except ValueError:
        checkpointer.close()
        raise
    metrics = MetricsLog(out_dir / "metrics.jsonl", truncate_after_step=resumed_at, primary=primary)
    try:
        return _steps(
            state,
            start,
            options,
            dataset,
            batch_size,
            evaluate,
            metrics,
            trackers,
            checkpointer,
            parallelism,
            make_train_step(optimizer, schedule, trained),
            save=lambda state: _save(state, checkpointer, options, metadata.replace(config=config), trained),
        )
    finally:
        trackers.close()
        checkpointer.close()


def _save(state: TrainState, checkpointer: Checkpointer, options: RunOptions, metadata: RunMetadata, trained) -> None:
    step = _int(state.step)
    record = metadata.replace(step=step, data_step=_int(state.data_step), seed=options.seed)
    if metadata.base is not None:  # the rest is the base's: only what training changes is saved
        state = eqx.tree_at(lambda s: s.model, state, changed_part(state.model, trained))
    checkpointer.save(step, state, record.to_json())


def _host_terms(terms: dict) -> dict[str, float | list[float]]:
    """Numbers for metrics.jsonl: scalars as floats, per-layer values as lists."""
    terms = parallel.to_host(terms)
    return {name: float(v) if np.ndim(v) == 0 else [float(x) for x in np.ravel(v)] for name, v in terms.items()}


def _log(metrics: MetricsLog, trackers: Trackers, record: dict) -> None:
    metrics.write(record)
    trackers.record(record)


def _log_eval(metrics: MetricsLog, trackers: Trackers, record: dict, out_dir: Path) -> None:
    _log(metrics, trackers, record)
    if trackers.names:  # the run's plots, as they stand at this evaluation
        plot_metrics(metrics.records(), out_dir / "metrics.png")
        trackers.image(int(record["step"]), "metrics", out_dir / "metrics.png")


def _steps(
    state, start, options, dataset, batch_size, evaluate, metrics, trackers, checkpointer, parallelism, train_step, save
) -> TrainResult:
    shard = (jax.process_index(), jax.process_count())
    progress = Progress(options.steps, start, enabled=jax.process_index() == 0)
    window_tokens, window_start, compile_seconds = 0.0, time.perf_counter(), None
    last_terms: dict = {}
    throughput = []
    for step in range(start, options.steps):
        rows = dataset.batch_at(_int(state.data_step), batch_size, options.seed, shard=shard)
        tokens = float(np.sum(rows.segment_ids > 0)) * shard[1]
        started = time.perf_counter()
        state, terms = train_step(device_batch(rows, parallelism), state)
        terms = _host_terms(terms)
        if compile_seconds is None:
            compile_seconds = time.perf_counter() - started
            window_start = time.perf_counter()
        else:
            window_tokens += tokens
        bad = [name for name, value in terms.items() if not np.all(np.isfinite(value))]
        if bad:
            progress.close()
            raise FloatingPointError(
                f"step {step + 1}: non-finite {', '.join(bad)}; stopped, the last good checkpoint "
                f"is step {checkpointer.latest_step()}"
            )
        done = step + 1
        if done % options.log_every == 0 or done == options.steps:
            elapsed = max(time.perf_counter() - window_start, 1e-9)
            last_terms = terms
            tokens_per_second = window_tokens / elapsed
            if window_tokens:
                throughput.append(tokens_per_second)
            _log(metrics, trackers, {"step": done, **last_terms, "tokens_per_second": tokens_per_second})
            progress.update(done, terms["loss"], tokens_per_second, last_terms["learning_rate"])
        if done % options.eval_every == 0 and done != options.steps:
            _log_eval(metrics, trackers, {"step": done, **evaluate(state.model)}, options.out_dir)
        if done % options.checkpoint_every == 0 or done == options.steps:
            save(state)
    progress.close()
    final_eval = evaluate(state.model)
    already = any(r.get("step") == options.steps and final_eval.keys() <= r.keys() for r in metrics.records())
    if not already:  # a resumed run that had already finished has written its final evaluation
        _log_eval(metrics, trackers, {"step": options.steps, **final_eval}, options.out_dir)
    median = float(np.median(throughput)) if throughput else None
    return TrainResult(state, metrics, last_terms, final_eval, median, compile_seconds)
