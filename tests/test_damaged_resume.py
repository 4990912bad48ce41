"""``--resume`` over a damaged latest checkpoint, as a user runs it: a command of its own (so that what orbax's and
tensorstore's threads print reaches stderr as it would a terminal), the fallback said in one line and nothing else,
and the run ends at the uninterrupted run's loss.

The failed read of the damaged step leaves tensorstore's other reads of that step completing afterwards, on threads
of their own, which made a traceback appear in some runs and not in others; one attempt runs by default, all five
with ``python -m pytest -n 0 tests/test_damaged_resume.py -m 'slow or not slow'``."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--seq-len=32",
    "--batch-size=2",
    "--chars-per-domain=3000",
    "--eval-chars-per-domain=800",
    "--steps=4",
    "--checkpoint-every=2",
    "--eval-every=100",
    "--log-every=2",
    "--peak-tflops=1",  # the logged MFU's peak, given: nothing to measure
]


def _pretrain(out_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "experiments.pretrain", f"--out-dir={out_dir}", *extra]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, dict]:
    """An uninterrupted 4-step run (checkpoints at steps 2 and 4) and its summary."""
    out = tmp_path_factory.mktemp("runs") / "straight"
    run = _pretrain(out, *TINY)
    assert run.returncode == 0, run.stderr[-3000:]
    return out, json.loads((out / "summary.json").read_text())


def damage_latest_step(run: Path, step: int) -> Path:
    """Cut the largest file of the step in half, as a full disk or a copy cut short leaves it."""
    largest = max(
        (p for p in (run / "checkpoints" / str(step)).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    os.truncate(largest, largest.stat().st_size // 2)
    return largest


@pytest.mark.parametrize("attempt", [0, *(pytest.param(n, marks=pytest.mark.slow) for n in range(1, 5))])
def test_resume_over_a_damaged_checkpoint_prints_its_one_line_and_nothing_else(straight, tmp_path, attempt):
    out, summary = straight
    run = tmp_path / "run"
    shutil.copytree(out, run)
    (run / "summary.json").unlink()
    damage_latest_step(run, 4)

    resumed = _pretrain(run, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    err = resumed.stderr
    assert "Traceback" not in err and "Exception ignored" not in err and "exception was never retrieved" not in err, err
    damaged = [line for line in err.splitlines() if "damaged" in line]
    assert len(damaged) == 1 and damaged[0].startswith("--resume: checkpoint step 4 is damaged"), err
    assert "resumed from step 2" in err
    assert json.loads((run / "summary.json").read_text())["final_loss"] == summary["final_loss"]
