"""Score a model on lm-evaluation-harness tasks, the way papers report them.

    python -m experiments.evaluate --hf path/to/Qwen3-30B-A3B --tasks hellaswag arc_easy --limit 100
    python -m experiments.evaluate --checkpoint runs/sft/checkpoints --tasks gsm8k --num-fewshot 5 --apply-chat-template
    python -m experiments.evaluate --hf DIR --tasks my_task --include-path tasks/ --out-dir runs/eval

The model is lm-eval's ``eqmoe`` backend (:class:`eqmoe.evaluation.lm_eval_model.EqmoeLM`): a Hugging Face folder or
Hub id, or an eqmoe checkpoint (``convert`` output or a training run's ``checkpoints``, its LoRA adapters applied), read
with the folder's tokenizer (or the one the run recorded) and, with ``--apply-chat-template``, its chat template.
Log-likelihoods are batched by length, perplexity uses lm-eval's rolling windows of ``--max-length`` tokens and
generation is greedy through ``eqmoe.inference`` unless a task samples.

Writes ``results.json`` (lm-eval's results; ``samples.jsonl`` with ``--log-samples``) and ``results.md`` (lm-eval's
table, also printed) in ``--out-dir``, and the scores to ``--tracker`` (TensorBoard, W&B). Needs lm-eval
(``pip install 'eqmoe[eval]'``). A task lm-eval does not know (``--include-path DIR`` adds local task YAMLs), data it
cannot read or a tokenizer that does not fit the model is one line on stderr and exit code 2.
"""

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import tyro

from eqmoe.train.logging import write_json_atomic
from eqmoe.train.loop import OutputOptions
from eqmoe.train.tracking import TrackerOptions, start_trackers
from experiments._cli import UsageError, guarded
from experiments.options import DtypeOption, EvalTaskOptions, MeshOptions, ModelSourceOptions, TokenizerOption

INSTALL = "pip install 'eqmoe[eval]'"


@dataclass(frozen=True)
class Args(
    ModelSourceOptions, TokenizerOption, DtypeOption, MeshOptions, EvalTaskOptions, TrackerOptions, OutputOptions
):
    tasks: tuple[str, ...] = ()
    """lm-eval task (or group) names, e.g. hellaswag arc_easy; local ones need --include-path."""
    out_dir: Path = Path("runs/eval")
    log_samples: bool = False
    """Also write every request and response (samples.jsonl)."""
    seed: int = 0
    """Seed of lm-eval's few-shot sampling and of any sampled generation."""


def harness():
    """lm-eval's evaluator with the eqmoe model registered; a one-line error naming the install when it is missing."""
    try:
        from eqmoe.evaluation import harness
    except ImportError as error:
        if error.name is not None and error.name.split(".")[0] != "lm_eval":
            raise
        raise UsageError(f"evaluation needs lm-evaluation-harness: {INSTALL}") from None
    return harness


def evaluate_model(options: EvalTaskOptions, tasks: tuple[str, ...], source, parallelism=None) -> dict:
    """The scores (``{task: {metric: value}}``) of the loaded model ``source`` (a
    :class:`eqmoe.checkpoints.source.ModelSource`) on ``tasks``: what ``--eval-tasks`` adds to a run's summary."""
    lm_harness = harness()
    manager = lm_harness.task_manager(tasks, options.include_path)
    from eqmoe.evaluation.lm_eval_model import EqmoeLM

    lm = EqmoeLM(
        source=source, parallelism=parallelism, batch_size=options.eval_batch_size, max_length=options.max_length
    )
    results = lm_harness.evaluate(
        lm,
        tasks,
        manager,
        limit=options.limit,
        num_fewshot=options.num_fewshot,
        apply_chat_template=options.apply_chat_template,
    )
    return lm_harness.scores(results)


def print_lm_eval(scores: dict | None) -> None:
    """A training command's closing lines for its ``--eval-tasks`` scores (nothing without them)."""
    for task, values in (scores or {}).items():
        shown = "  ".join(f"{name} {value:.4f}" for name, value in values.items() if not name.endswith("_stderr"))
        print(f"  lm-eval {task}: {shown}")


def check_eval_tasks(options: EvalTaskOptions, tasks: tuple[str, ...]) -> None:
    """Refuse unknown tasks or unreadable task data before a run trains (nothing to check without tasks)."""
    if tasks:
        harness().task_manager(tasks, options.include_path)


def _check(args: Args) -> None:
    if not args.tasks:
        raise UsageError("give --tasks NAME [NAME ...] (lm-eval tasks; local YAMLs with --include-path DIR)")
    if args.limit is not None and args.limit <= 0:
        raise UsageError(f"--limit {args.limit:g}: must be positive")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UsageError(f"--num-fewshot {args.num_fewshot}: must be >= 0")
    if args.eval_batch_size < 1:
        raise UsageError(f"--eval-batch-size {args.eval_batch_size}: must be at least 1")
    if args.max_length is not None and args.max_length < 2:
        raise UsageError(f"--max-length {args.max_length}: must be at least 2")
    if (args.hf is None) == (args.checkpoint is None):
        raise UsageError("give one of --hf DIR (a Hugging Face folder or Hub id) or --checkpoint DIR")


def run(args: Args) -> dict:
    _check(args)
    lm_harness = harness()
    manager = lm_harness.task_manager(args.tasks, args.include_path)  # before the model: a bad task fails fast
    from eqmoe.evaluation.lm_eval_model import EqmoeLM

    parallelism = args.build()
    lm = EqmoeLM(
        hf=None if args.hf is None else str(args.hf),
        checkpoint=None if args.checkpoint is None else str(args.checkpoint),
        step=args.step,
        base=None if args.base is None else str(args.base),
        tokenizer=None if args.tokenizer is None else str(args.tokenizer),
        dtype=args.dtype,
        batch_size=args.eval_batch_size,
        max_length=args.max_length,
        parallelism=parallelism,
    )
    start = time.perf_counter()
    results = lm_harness.evaluate(
        lm,
        args.tasks,
        manager,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        apply_chat_template=args.apply_chat_template,
        log_samples=args.log_samples,
        seed=args.seed,
    )
    seconds = time.perf_counter() - start
    samples = results.pop("samples", None)
    scores = lm_harness.scores(results)
    table = lm_harness.results_table(results)
    if jax.process_index() == 0:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        record = {"scores": scores, "seconds": seconds, "args": dataclasses.asdict(args), "lm_eval": results}
        write_json_atomic(args.out_dir / "results.json", json.loads(json.dumps(record, default=str)))
        _write_atomic(args.out_dir / "results.md", table)
        if samples is not None:
            lines = [json.dumps({"task": task, **row}, default=str) for task, rows in samples.items() for row in rows]
            _write_atomic(args.out_dir / "samples.jsonl", "".join(line + "\n" for line in lines))
        config = json.loads(json.dumps(dataclasses.asdict(args), default=str))
        trackers = start_trackers(args.tracker, args.out_dir, config, resumed_at=None, wandb_project=args.wandb_project)
        flat = {f"lm_eval/{task}/{name}": value for task, values in scores.items() for name, value in values.items()}
        trackers.record({"step": args.step or 0, **flat})
        trackers.close()
    print(f"evaluate: {len(scores)} task(s) in {seconds:.1f}s -> {args.out_dir}", file=sys.stderr)
    return {"scores": scores, "table": table}


def _write_atomic(path: Path, text: str) -> None:
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(text)
    staging.replace(path)  # a reader never sees half a file


def main(args: Args) -> int:
    result = guarded("evaluate", run, args)
    if result is None:
        return 2
    print(result["table"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
