"""experiments.param_report: exact Qwen3-MoE counts from shapes alone, its JSON output and its errors."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.param_report import Args, main

REPO_ROOT = Path(__file__).resolve().parents[1]


def report_json(capsys: pytest.CaptureFixture[str], preset: str) -> dict:
    assert main(Args(preset=preset, json=True)) == 0
    return json.loads(capsys.readouterr().out)


def test_qwen3_30b_a3b_table(capsys):
    start = time.perf_counter()
    assert main(Args(preset="qwen3-30b-a3b")) == 0
    assert time.perf_counter() - start < 30
    out = capsys.readouterr().out
    assert "30,532,122,624" in out
    assert "3,353,032,704" in out
    assert "ffn.experts.gate.weight" in out


@pytest.mark.parametrize(
    ("preset", "total", "active"),
    [("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704), ("qwen3-235b-a22b", 235_093_634_560, 22_190_763_520)],
)
def test_counts_json(capsys, preset, total, active):
    start = time.perf_counter()
    report = report_json(capsys, preset)
    assert time.perf_counter() - start < 30
    assert (report["preset"], report["total"], report["active"]) == (preset, total, active)
    assert sum(row["count"] for row in report["parameters"]) == total
    routed = [row for row in report["parameters"] if row["routed"]]
    assert {row["path"].rsplit(".", 2)[-2] for row in routed} == {"gate", "up", "down"}


def test_unknown_preset_exits_2(capsys):
    assert main(Args(preset="no-such-model")) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert "unknown preset 'no-such-model'" in lines[0]
    assert "qwen3-30b-a3b" in lines[0]


def test_cli_subprocess_json():
    result = subprocess.run(
        [sys.executable, "-m", "experiments.param_report", "--preset", "qwen3-moe-tiny", "--json"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["preset"] == "qwen3-moe-tiny"
    assert isinstance(report["total"], int) and isinstance(report["active"], int)
    assert 0 < report["active"] < report["total"]


# -m slow: the one line and exit 2 are test_unknown_preset_exits_2's (main's), the command's entry
# test_cli_subprocess_json's
@pytest.mark.slow
def test_cli_subprocess_unknown_preset():
    result = subprocess.run(
        [sys.executable, "-m", "experiments.param_report", "--preset", "no-such-model"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "unknown preset 'no-such-model'" in result.stderr
