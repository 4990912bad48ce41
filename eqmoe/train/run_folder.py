"""A training run's folder: never overwritten by accident, its arguments kept for ``--resume``, and damaged
checkpoints set aside rather than stopping a resume.

A folder *holds a run* once any of :data:`RUN_OUTPUTS` is in it. A new run there is refused unless it resumes
(``--resume``) or replaces it (``--overwrite``, which removes only those outputs, never other files). A
checkpoint step that cannot be read whole is moved to ``checkpoints-set-aside/`` beside ``checkpoints/`` (so
nothing is deleted), and the resume falls back to the newest step that reads.
"""

import json
import shutil
from pathlib import Path

from eqmoe.train.logging import write_json_atomic

ARGUMENTS_FILE = "arguments.json"
SET_ASIDE = "checkpoints-set-aside"
RUN_OUTPUTS = (
    "checkpoints",
    "metrics.jsonl",
    "summary.json",
    ARGUMENTS_FILE,
    "metrics.png",
    "routing.png",
    "tensorboard",
    "wandb",
)


def run_outputs(out_dir: Path) -> list[str]:
    """The outputs of an earlier run present in ``out_dir`` (empty files and folders do not count)."""
    found = []
    for name in RUN_OUTPUTS:
        path = out_dir / name
        if path.is_file() and path.stat().st_size > 0 or path.is_dir() and any(path.iterdir()):
            found.append(name)
    return found


def claim(out_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse (``FileExistsError``, one line) a new run in a folder that holds one, unless ``resume`` or
    ``overwrite``; with ``overwrite`` remove the earlier run's outputs."""
    if resume:
        return
    found = run_outputs(out_dir)
    if found and not overwrite:
        raise FileExistsError(
            f"{out_dir}: already holds a run ({', '.join(found)}); pass --resume to continue it, --overwrite to "
            "replace it, or another --out-dir"
        )
    for name in found:
        path = out_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def write_arguments(out_dir: Path, arguments: dict) -> None:
    """Record the command's arguments, which ``--resume`` alone replays."""
    write_json_atomic(out_dir / ARGUMENTS_FILE, arguments)


def read_arguments(out_dir: Path) -> dict | None:
    """The arguments the run in ``out_dir`` recorded (``None``: none recorded)."""
    path = out_dir / ARGUMENTS_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path}: unreadable ({error})") from None


def set_aside(checkpoints: Path, step: int) -> Path:
    """Move the step folder out of ``checkpoints`` (so that it is neither restored nor deleted); its new path."""
    folder = checkpoints.parent / SET_ASIDE
    folder.mkdir(exist_ok=True)
    target = folder / str(step)
    suffix = 1
    while target.exists():
        target, suffix = folder / f"{step}.{suffix}", suffix + 1
    (checkpoints / str(step)).rename(target)
    return target
