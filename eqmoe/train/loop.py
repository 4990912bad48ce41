"""The training loop every experiment shares: resume, train, log, evaluate, checkpoint.

A run is reproducible from its options alone: the data order depends only on the seed and the
checkpointed ``data_step``, so a run stopped anywhere and resumed from its last checkpoint takes
exactly the steps an uninterrupted run takes.
"""

import functools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar, NamedTuple

import equinox as eqx
import jax
import numpy as np

from eqmoe import autotune, flops, parallel
from eqmoe.checkpoints.model_checkpoint import changed_part
from eqmoe.checkpoints.orbax import Checkpointer
from eqmoe.checkpoints.run_metadata import RunMetadata
from eqmoe.config_io import config_to_dict
from eqmoe.data import PackedDataset
from eqmoe.model import Transformer
from eqmoe.train import memory_fit, resume, run_folder
from eqmoe.train.logging import MetricsLog, Progress, plot_metrics
from eqmoe.train.optimizer import OptimizerConfig, make_optimizer, trained_roles
from eqmoe.train.state import TrainState, hold_frozen, init_state
from eqmoe.train.step import device_batch, make_train_step
from eqmoe.train.tracking import TrackerOptions, Trackers, start_trackers


@dataclass(frozen=True)
class OutputOptions:
    out_dir: Path = Path("runs/train")
    """The output folder: everything the command writes goes here (its description lists what)."""


@dataclass(frozen=True)
class RunOptions(OutputOptions, TrackerOptions):
    # how long, how often and where it reports may change when a run is resumed; the seed may not
    changeable_on_resume: ClassVar[frozenset[str]] = frozenset(
        {
            "steps",
            "checkpoint_every",
            "keep_checkpoints",
            "eval_every",
            "log_every",
            "tracker",
            "wandb_project",
            "peak_tflops",
            "device_memory_gib",
        }
    )

    steps: int = 1600
    """Total optimizer steps of the run (a resumed run continues up to this)."""
    grad_accum: int = 1
    """Micro-batches of --batch-size rows per optimizer step, their gradients summed in a scan: a step sees the
    data of one batch of grad_accum x --batch-size rows, holding the activations of one micro-batch at a time."""
    resume: bool = False
    """Continue the run in --out-dir from its latest readable checkpoint, with its stored arguments (flags given
    again may change how it executes: steps, dtype, remat, dispatch, mesh, logging, trackers)."""
    resume_from: int | None = None
    """With --resume: continue from this checkpoint step (later steps are moved to checkpoints-set-aside/)."""
    overwrite: bool = False
    """Replace what is already at the output (the run in --out-dir, or the output folder) instead of refusing."""
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
    peak_tflops: float | None = None
    """Each device's peak TFLOP/s, against which the logged MFU is taken (default: the device's specified peak for the
    run's dtype, :data:`eqmoe.flops.SPECIFIED_PEAKS`, e.g. 197 for a bf16 run on a TPU v5e; on a CPU its matmul rate in
    that dtype, measured once at the first log line on 2048 x 2048 products)."""

    device_memory_gib: float | None = None
    """Memory one device has for a train step, GiB (default: what the device reports, e.g. 15.75 on a TPU v5e; a CPU
    reports none, so there the step's fit is checked only when this is given). A step that does not fit stops before
    the run writes anything, naming settings that fit; --remat auto picks the least recomputation that fits."""

    def check(self) -> None:
        """A ``ValueError`` naming the first option that is not a positive number."""
        for name in ("steps", "grad_accum", "checkpoint_every", "keep_checkpoints", "eval_every", "log_every"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"--{name.replace('_', '-')}={value} is invalid; allowed: a positive number")
        for name in ("peak_tflops", "device_memory_gib"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')}={value} is invalid; allowed: a positive number")
        if self.resume_from is not None and not self.resume:
            raise ValueError(f"--resume-from {self.resume_from}: goes with --resume")
        if self.resume and self.overwrite:
            raise ValueError("give --resume (continue the run in --out-dir) or --overwrite (replace it), not both")

    def claim_out_dir(self) -> None:
        """Refuse to start a new run in a folder that holds one (see :mod:`eqmoe.train.run_folder`). Of several
        processes, process 0 alone looks (and removes, with ``--overwrite``) and every process refuses with it: another
        process would take the outputs process 0 has begun to write for an earlier run's. Call it after
        :meth:`eqmoe.parallel.initialize_distributed`."""
        refusal = None
        if jax.process_index() == 0:
            try:
                run_folder.claim(self.out_dir, resume=self.resume, overwrite=self.overwrite)
            except FileExistsError as error:
                refusal = error
        if jax.process_count() > 1 and parallel.from_process_zero(refusal is not None) and refusal is None:
            refusal = FileExistsError(f"{self.out_dir}: process 0 refused it (already holds a run)")
        if refusal is not None:
            raise refusal


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


def _int(value) -> int:
    return int(parallel.to_host(value))


def _train(
    model, optimizer_config, options, dataset, batch_size, evaluate, metadata, parallelism, arguments
) -> TrainResult:
    options.check()
    optimizer_config = optimizer_config.for_run(options.steps)
    config, out_dir = model.config, options.out_dir
    checkpointer = Checkpointer(out_dir / "checkpoints", keep_last=options.keep_checkpoints)
    try:
        if options.resume:
            options.claim_out_dir()
        # the config as given (``auto`` included) is what checkpoints store; the model runs the chosen backends
        resolved = autotune.resolve(
            config,
            batch_size,
            dataset.seq_len,
            recorded=resume.recorded_backends(checkpointer) if options.resume else None,
            devices=1 if parallelism is None else parallelism.mesh.size,
        )
        if resolved.config != config:
            model = model.with_config(resolved.config)
        metadata = metadata.replace(backends=resolved.choices or None)
        params = eqx.filter(model, eqx.is_array)
        optimizer, schedule = make_optimizer(optimizer_config, params, embed_dim=config.embed_dim)
        trained = trained_roles(optimizer_config, params)
        model = hold_frozen(model, trained)
        key = jax.random.key(options.seed + 1)
        state, latest = resume.resumed_state(
            checkpointer, options, model, optimizer, key, metadata, parallelism, trained
        )
    except BaseException:
        checkpointer.close()
        raise
    if state is None:
        state = init_state(model, optimizer, key=key, parallelism=parallelism)
    del model
    shard = (jax.process_index(), jax.process_count())
    try:  # the step must fit the device before the run writes anything
        rows = dataset.batch_at(_int(state.data_step), batch_size * options.grad_accum, options.seed, shard=shard)
        state, train_step = memory_fit.fit(
            state,
            optimizer,
            lambda: make_train_step(optimizer, schedule, trained, options.grad_accum),
            device_batch(rows, parallelism),
            stated_gib=options.device_memory_gib,
            rows=batch_size,
            grad_accum=options.grad_accum,
        )
        if not options.resume:
            options.claim_out_dir()
    except BaseException:
        checkpointer.close()
        raise
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
    if primary and arguments is not None:
        run_folder.write_arguments(out_dir, arguments)
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
            train_step,
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


class _Utilisation:
    """The logged compute rates: ``model_flops_per_token`` (:func:`eqmoe.flops.model_flops_per_token` at
    the batch's row length), ``tflops_per_device`` and ``mfu`` (over ``peak_tflops``, or the device's peak for the
    run's dtype: specified, or on a CPU measured once per process, before the first step)."""

    def __init__(self, config, peak_tflops: float | None, *, steps_to_run: bool):
        # Measured here rather than at the first log line, which fell inside the tokens/s window: ~1 s of a 300-step
        # quickstart's ~32 s window on 2 cores, 3% off its reported rate.
        measure = peak_tflops is None and steps_to_run
        self.config, self.peak, self.flops = config, _measured_peak(config.dtype) if measure else peak_tflops, {}

    def of(self, tokens_per_second: float, seq: int) -> dict[str, float]:
        if seq not in self.flops:
            self.flops[seq] = flops.model_flops_per_token(self.config, seq)
        if self.peak is None:  # no steps were to run when it was made
            self.peak = _measured_peak(self.config.dtype)
        per_device = tokens_per_second * self.flops[seq] / jax.device_count() / 1e12
        return {
            "model_flops_per_token": self.flops[seq],
            "tflops_per_device": per_device,
            "mfu": per_device / self.peak,
        }


@functools.cache
def _measured_peak(dtype: str) -> float:
    # the device's specified peak for the run's dtype (a TPU's bf16 rate for bf16 runs); on a CPU its matmul rate in
    # that dtype at 2048^2 rather than bench_model's 4096^2: the same rate within a few percent on a 2-core CPU (274
    # vs 262 GFLOP/s measured) in an eighth of the time, which every run pays
    return flops.device_peak_tflops(dtype)[0]


def _steps(
    state, start, options, dataset, batch_size, evaluate, metrics, trackers, checkpointer, parallelism, train_step, save
) -> TrainResult:
    shard = (jax.process_index(), jax.process_count())
    progress = Progress(options.steps, start, enabled=jax.process_index() == 0)
    window_tokens, window_start, compile_seconds = 0.0, time.perf_counter(), None
    last_terms: dict = {}
    throughput = []
    utilisation = _Utilisation(state.model.config, options.peak_tflops, steps_to_run=start < options.steps)
    data_step = _int(state.data_step)
    pending = None  # an ordinary step's terms, read on the host after the next step is dispatched

    def check(step: int, terms: dict) -> dict:
        terms = _host_terms(terms)
        bad = [name for name, value in terms.items() if not np.all(np.isfinite(value))]
        if bad:
            progress.close()
            raise FloatingPointError(
                f"step {step + 1}: non-finite {', '.join(bad)}; stopped, the last good checkpoint "
                f"is step {checkpointer.latest_step()}"
            )
        return terms

    for step in range(start, options.steps):
        rows = dataset.batch_at(data_step, batch_size * options.grad_accum, options.seed, shard=shard)
        tokens = float(np.sum(rows.segment_ids > 0)) * shard[1]
        started = time.perf_counter()
        state, terms = train_step(device_batch(rows, parallelism), state)
        data_step += 1
        if pending is not None:  # the step before, checked while this one runs
            check(*pending)
            pending = None
        done = step + 1
        logged = done % options.log_every == 0 or done == options.steps
        evaluated = done % options.eval_every == 0 and done != options.steps
        saved = done % options.checkpoint_every == 0 or done == options.steps
        if compile_seconds is not None and not (logged or evaluated or saved):
            # nothing reads this step's state now: the host does not wait for it, so the next step's batch and
            # dispatch overlap its compute (its terms are checked before anything is logged, evaluated or saved)
            window_tokens += tokens
            pending = (step, terms)
            continue
        terms = check(step, terms)
        if compile_seconds is None:
            compile_seconds = time.perf_counter() - started
            window_start = time.perf_counter()
        else:
            window_tokens += tokens
        if logged:
            elapsed = max(time.perf_counter() - window_start, 1e-9)
            last_terms = terms
            tokens_per_second = window_tokens / elapsed
            if window_tokens:
                throughput.append(tokens_per_second)
            rates = utilisation.of(tokens_per_second, rows.tokens.shape[1])
            _log(metrics, trackers, {"step": done, **last_terms, "tokens_per_second": tokens_per_second, **rates})
            progress.update(done, terms["loss"], tokens_per_second, last_terms["learning_rate"], rates["mfu"])
        if evaluated:
            _log_eval(metrics, trackers, {"step": done, **evaluate(state.model)}, options.out_dir)
        if saved:
            save(state)
    progress.close()
    final_eval = evaluate(state.model)
    already = any(r.get("step") == options.steps and final_eval.keys() <= r.keys() for r in metrics.records())
    if not already:  # a resumed run that had already finished has written its final evaluation
        _log_eval(metrics, trackers, {"step": options.steps, **final_eval}, options.out_dir)
    median = float(np.median(throughput)) if throughput else None
    return TrainResult(state, metrics, last_terms, final_eval, median, compile_seconds)
