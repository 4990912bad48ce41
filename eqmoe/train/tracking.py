"""Experiment trackers beside ``metrics.jsonl``: TensorBoard event files (tensorboardX) and Weights & Biases.

``metrics.jsonl`` is always written and is the record of a run; a tracker is a view of it. A tracker that
cannot start stops the run before its first step with one line naming it; one that fails later is reported
once and switched off, and training goes on. Per-layer values (lists in ``metrics.jsonl``) become one scalar
per layer, ``{name}/layer_{i:02d}``.
"""

import contextlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

TrackerName = Literal["jsonl", "tensorboard", "wandb"]


@dataclass(frozen=True)
class TrackerOptions:
    tracker: tuple[TrackerName, ...] = ("jsonl",)
    """Where metrics go besides metrics.jsonl (always written): tensorboard (event files in OUT_DIR/tensorboard),
    wandb (W&B; WANDB_MODE=offline works without a network)."""
    wandb_project: str = "eqmoe"
    """W&B project of --tracker wandb."""


@runtime_checkable
class Tracker(Protocol):
    name: str

    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    def image(self, step: int, tag: str, path: Path) -> None: ...

    def close(self) -> None: ...


def flat_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record, per-layer lists spread into ``{name}/layer_{i:02d}`` (``step`` dropped)."""
    values = {}
    for name, value in record.items():
        if name == "step":
            continue
        if isinstance(value, list | tuple):
            values.update({f"{name}/layer_{i:02d}": float(v) for i, v in enumerate(value)})
        elif isinstance(value, int | float):
            values[name] = float(value)
    return values


class TensorBoard:
    """Event files under ``out_dir/tensorboard``; a resumed run first drops the events after its checkpoint."""

    name = "tensorboard"

    def __init__(self, out_dir: Path, config: dict, resumed_at: int | None):
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(logdir=str(out_dir / "tensorboard"), purge_step=resumed_at)
        self._writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def image(self, step: int, tag: str, path: Path) -> None:
        from matplotlib.image import imread

        self._writer.add_image(tag, imread(path)[..., :3], step, dataformats="HWC")
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandB:
    """A W&B run in ``out_dir/wandb`` (``WANDB_MODE=offline`` needs no network); its id is kept in
    ``out_dir/wandb_run_id`` so that ``--resume`` continues the same run."""

    name = "wandb"

    def __init__(self, out_dir: Path, config: dict, resumed_at: int | None, project: str):
        import wandb

        id_file = out_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resumed_at is not None and id_file.is_file() else None
        out_dir.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self._run = wandb.init(
            project=project,
            dir=str(out_dir),
            id=run_id,  # None: W&B makes one, kept in wandb_run_id for --resume
            resume="allow",
            name=out_dir.name,
            config=config,
        )
        id_file.write_text(self._run.id + "\n")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def image(self, step: int, tag: str, path: Path) -> None:
        self._run.log({tag: self._wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        self._run.finish()


class Trackers:
    """Every started tracker; a call that raises switches that tracker off with one warning."""

    def __init__(self, trackers: list[Tracker]):
        self._live = list(trackers)

    @property
    def names(self) -> list[str]:
        return [tracker.name for tracker in self._live]

    def _each(self, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self._live):
            try:
                call(tracker)
            except Exception as error:  # a tracker is never worth the run
                self._live.remove(tracker)
                print(
                    f"warning: tracker {tracker.name} failed ({type(error).__name__}: {error}); it is off for the rest "
                    "of the run (metrics.jsonl is complete)",
                    file=sys.stderr,
                )
                with contextlib.suppress(Exception):
                    tracker.close()

    def record(self, record: dict[str, Any]) -> None:
        """One ``metrics.jsonl`` record, at its ``step``."""
        values = flat_scalars(record)
        self._each(lambda tracker: tracker.scalars(int(record["step"]), values))

    def image(self, step: int, tag: str, path: Path) -> None:
        self._each(lambda tracker: tracker.image(step, tag, path))

    def close(self) -> None:
        self._each(lambda tracker: tracker.close())
        self._live = []


def start_trackers(
    names: tuple[str, ...], out_dir: Path, config: dict, *, resumed_at: int | None, wandb_project: str = "eqmoe"
) -> Trackers:
    """The trackers ``names`` asks for (``jsonl`` is ``metrics.jsonl`` itself); ``ValueError`` naming the one that
    cannot start."""
    started: list[Tracker] = []
    for name in dict.fromkeys(names):
        if name == "jsonl":
            continue
        try:
            if name == "tensorboard":
                started.append(TensorBoard(out_dir, config, resumed_at))
            elif name == "wandb":
                started.append(WandB(out_dir, config, resumed_at, wandb_project))
            else:
                raise ValueError("unknown tracker; allowed: jsonl, tensorboard, wandb")
        except ImportError as error:
            Trackers(started).close()
            raise ValueError(f"--tracker {name}: {error.name} is not installed (pip install {error.name})") from None
        except Exception as error:
            Trackers(started).close()
            raise ValueError(f"--tracker {name}: could not start ({type(error).__name__}: {error})") from None
    return Trackers(started)
