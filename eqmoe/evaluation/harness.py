"""lm-evaluation-harness's evaluator over an eqmoe model: tasks checked (names, data) before any model is read, the
results as lm-eval writes them, their scores as flat numbers and lm-eval's table."""

import contextlib
import functools
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import datasets
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from lm_eval.utils import make_table

from eqmoe.evaluation.lm_eval_model import EqmoeLM


def task_manager(tasks: Sequence[str], include_path: str | os.PathLike | None = None) -> TaskManager:
    """lm-eval's tasks plus the YAMLs under ``include_path``; ``ValueError`` in one line for a task it does not know
    or one whose data cannot be read (a missing file), so a bad name fails before the model is loaded."""
    if not tasks:
        raise ValueError("--tasks: name at least one lm-eval task")
    if include_path is not None and not Path(include_path).exists():
        raise FileNotFoundError(f"{include_path}: task folder not found (--include-path)")
    folder = None if include_path is None else str(Path(include_path).absolute())
    manager = None
    if folder is not None:  # indexing lm-eval's thousands of task files takes seconds: only when needed
        manager = _indexed(folder, defaults=False)
        if _unknown(manager, tasks):
            manager = None
    if manager is None:
        manager = _indexed(folder, defaults=True)
    unknown = _unknown(manager, tasks)
    if unknown:
        where = f" nor under {include_path}" if include_path is not None else " (local task YAMLs: --include-path DIR)"
        raise ValueError(f"--tasks: unknown task(s) {', '.join(unknown)}: not an lm-eval task{where}")
    with _quiet_datasets():  # a refusal is one line, not one after the datasets library's progress bars
        for name in tasks:
            try:
                manager.load([name])
            except Exception as error:  # datasets raises many kinds for a missing or unreadable data file
                raise ValueError(f"task {name}: cannot load its data: {type(error).__name__}: {error}") from None
    return manager


@contextlib.contextmanager
def _quiet_datasets():
    """No progress bars and no lm-eval warnings (a metric without its aggregation named) while tasks load."""
    shown, logger = datasets.is_progress_bar_enabled(), logging.getLogger("lm_eval")
    level = logger.level
    datasets.disable_progress_bars()
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
        if shown:
            datasets.enable_progress_bars()


@functools.lru_cache(maxsize=8)
def _indexed(folder: str | None, *, defaults: bool) -> TaskManager:
    """lm-eval's index of the task files (once per process: a training run checks its tasks, then runs them)."""
    return TaskManager(include_path=folder, include_defaults=defaults)


def _unknown(manager: TaskManager, tasks: Sequence[str]) -> list[str]:
    known = set(manager.all_tasks)
    return [name for name in tasks if name not in known and not manager.match_tasks([name])]


def evaluate(
    lm: EqmoeLM,
    tasks: Sequence[str],
    manager: TaskManager,
    *,
    limit: float | None = None,
    num_fewshot: int | None = None,
    apply_chat_template: bool = False,
    log_samples: bool = False,
    seed: int = 0,
) -> dict:
    """``lm_eval.simple_evaluate`` of ``lm`` on ``tasks``: the results dict lm-eval writes (``results``,
    ``configs``, ``n-shot``, ...; ``samples`` with ``log_samples``)."""
    return simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
        apply_chat_template=apply_chat_template,
        log_samples=log_samples,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
        verbosity="ERROR",
    )


def scores(results: dict) -> dict[str, dict[str, float]]:
    """Every task's metrics, ``{task: {"acc": ..., "acc_stderr": ...}}`` (lm-eval's ``,none`` filter suffix dropped;
    other filters keep theirs)."""
    table = {}
    for task, metrics in results["results"].items():
        values = {}
        for key, value in metrics.items():
            if key == "sample_len" or isinstance(value, bool) or not isinstance(value, int | float):
                continue  # the document count is not a score
            values[key.removesuffix(",none")] = float(value)
        table[task] = values
    return table


def results_table(results: dict) -> str:
    """lm-eval's Markdown table of the results (and of the groups, when there are any)."""
    text = make_table(results)
    if results.get("groups"):
        text += "\n" + make_table(results, "groups")
    return text
