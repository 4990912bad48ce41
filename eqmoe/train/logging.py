"""Run outputs: a progress line, ``metrics.jsonl``, ``metrics.png`` and atomic JSON files."""

import json
import math
import os
import sys
import tempfile
from pathlib import Path


def write_json_atomic(path: Path, value) -> None:
    """Write JSON to a temporary file beside ``path`` and rename it into place (paths are written as text)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as file:
            json.dump(value, file, indent=2, default=_path_as_text)
            file.write("\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _path_as_text(value):
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


class MetricsLog:
    """Appends one JSON object per logged step to ``metrics.jsonl`` (flushed every line).

    With ``primary=False`` (every process of a multi-process run but the first) nothing is written and
    :meth:`records` returns this process's own records."""

    def __init__(self, path: Path, *, truncate_after_step: int | None = None, primary: bool = True):
        self.path = path
        self.primary = primary
        self._records: list[dict] = []
        if not primary:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if truncate_after_step is not None and path.exists():
            # On resume, drop lines from steps the restored checkpoint had not reached yet.
            kept = [line for line in path.read_text().splitlines() if _step_of(line) <= truncate_after_step]
            write_lines = "".join(line + "\n" for line in kept)
            path.write_text(write_lines)
        elif truncate_after_step is None:
            path.write_text("")

    def write(self, record: dict) -> None:
        if not self.primary:
            self._records.append(record)
            return
        with open(self.path, "a") as file:
            file.write(json.dumps(record) + "\n")

    def records(self) -> list[dict]:
        if not self.primary:
            return list(self._records)
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def _step_of(line: str) -> int | float:
    try:
        return json.loads(line).get("step", math.inf)
    except json.JSONDecodeError:
        return math.inf


class Progress:
    """Training progress: a tqdm bar (step, loss, tokens/s, MFU, learning rate, ETA) on a terminal, a plain line per
    logged step otherwise (CI logs)."""

    def __init__(self, total_steps: int, start_step: int = 0, *, enabled: bool = True):
        self.total, self.enabled = total_steps, enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="training", unit="step", file=sys.stderr)

    def update(
        self, step: int, loss: float, tokens_per_second: float, learning_rate: float, mfu: float | None = None
    ) -> None:
        if not self.enabled:
            return
        rate = f"{tokens_per_second:,.0f} tok/s" + ("" if mfu is None else f" (MFU {100 * mfu:.1f}%)")
        if self.bar is None:
            line = f"step {step}/{self.total}  loss {loss:.4f}  {rate}  lr {learning_rate:.2e}"
            print(line, file=sys.stderr, flush=True)
            return
        self.bar.set_postfix_str(f"loss {loss:.4f}  {rate}  lr {learning_rate:.2e}", refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def plot_metrics(records: list[dict], path: Path) -> None:
    """``metrics.png``: training and eval loss, then whichever of held-out exact match, expert-load
    balance and expert-domain mutual information the records carry, over steps."""
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    panels = [
        (name, title, source)
        for name, title, source in (
            ("eval_accuracy", "held-out exact match", evals),
            ("load_cv", "expert load: coefficient of variation (0 = uniform)", train),
            ("max_vio", "expert load: MaxVio, max over mean - 1 (0 = uniform)", train),
            ("eval_domain_nmi", "expert-domain mutual information (normalised)", evals),
        )
        if any(name in r for r in source)
    ]
    figure = new_figure(figsize=(5 * (1 + len(panels)), 4))
    axes = figure.subplots(1, 1 + len(panels), squeeze=False)
    axes = axes[0]
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    axes[0].plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    axes[0].set_xlabel("step")
    axes[0].set_yscale("log")
    axes[0].legend()
    for axis, (name, title, source) in zip(axes[1:], panels, strict=True):
        kept = [r for r in source if name in r]
        axis.plot([r["step"] for r in kept], [r[name] for r in kept], "o-" if source is evals else "-")
        if name in ("eval_accuracy", "eval_domain_nmi"):
            axis.set_ylim(0, 1)
        axis.set_title(title)
        axis.set_xlabel("step")
    save_figure(figure, path)


def new_figure(**options):
    """A matplotlib ``Figure`` not registered with pyplot: saving it never switches the caller's backend
    (a notebook keeps its inline plots) and nothing needs closing."""
    from matplotlib.figure import Figure

    return Figure(**options)


def save_figure(figure, path: Path) -> None:
    """Save a matplotlib figure to ``path`` through a temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp{path.suffix}")
    figure.savefig(temporary, dpi=100)
    os.replace(temporary, path)
