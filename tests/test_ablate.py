"""The ablation grid: reproducible rows, skipping finished variants and resuming an interrupted one."""

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import tyro

from eqmoe import presets
from eqmoe.config import apply_overrides
from experiments import ablate, pretrain

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(
    steps=24,
    batch_size=4,
    seq_len=64,
    eval_every=8,
    checkpoint_every=8,
    chars_per_domain=6_000,
    eval_chars_per_domain=1_500,
)
TINY_FLAGS = [f"--{name.replace('_', '-')}={value}" for name, value in TINY.items()]


def test_every_variant_builds_and_its_printed_command_reproduces_its_arguments(tmp_path):
    args = ablate.Args(out_dir=tmp_path, **TINY)
    for name, overrides in ablate.VARIANTS.items():
        apply_overrides(presets.get(args.preset), {**ablate.BASE_OVERRIDES, **overrides})  # valid config
        variant = ablate.pretrain_args(args, name)
        words = shlex.split(ablate.command(variant))
        assert words[:3] == ["python", "-m", "experiments.pretrain"]
        parsed = tyro.cli(pretrain.Args, args=words[3:], config=(tyro.conf.OmitArgPrefixes,))
        assert parsed == variant, name
        assert pretrain.model_config(parsed.model) == pretrain.model_config(variant.model)


def _ablate(out_dir: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "experiments.ablate", "--variants", "baseline", "--out-dir", str(out_dir)]
    return subprocess.Popen(
        [*command, *TINY_FLAGS, *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_killed_variant_resumes_and_finished_variants_are_skipped(tmp_path):
    reference = ablate.run(ablate.Args(out_dir=tmp_path / "straight", variants=("baseline",), **TINY))

    out_dir = tmp_path / "killed"
    process = _ablate(out_dir)
    checkpoint = out_dir / "baseline" / "checkpoints" / "8"
    deadline = time.monotonic() + 240
    while not checkpoint.is_dir() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert checkpoint.is_dir(), process.communicate()[1]
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (out_dir / "baseline" / "summary.json").exists()

    resumed = _ablate(out_dir)
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert "resumed from step" in err
    results = json.loads((out_dir / "results.json").read_text())
    row, expected = results["variants"]["baseline"], reference["variants"]["baseline"]
    assert row["eval_loss"] == expected["eval_loss"] and row["load_cv"] == expected["load_cv"]
    assert row["overrides"] == {} and row["all_overrides"] == ablate.BASE_OVERRIDES
    assert "python -m experiments.pretrain" in (out_dir / "results.md").read_text()

    summary = out_dir / "baseline" / "summary.json"
    written = summary.stat().st_mtime_ns
    again = ablate.run(ablate.Args(out_dir=out_dir, variants=("baseline",), **TINY))
    assert summary.stat().st_mtime_ns == written
    assert again["variants"]["baseline"]["eval_loss"] == expected["eval_loss"]
    for name in ("results.md", "eval_loss.png", "load_balance.png"):
        assert (out_dir / name).is_file()


def test_a_variant_added_in_one_line_is_runnable(tmp_path, monkeypatch):
    monkeypatch.setitem(ablate.VARIANTS, "top3", {"moe.router.top_k": 3})
    results = ablate.run(ablate.Args(out_dir=tmp_path, variants=("top3",), **{**TINY, "steps": 4}))
    assert results["variants"]["top3"]["all_overrides"]["moe.router.top_k"] == 3
    assert json.loads((tmp_path / "top3" / "summary.json").read_text())["config"]["moe"]["router"]["top_k"] == 3


def test_unknown_variants_and_changed_settings_are_one_line_errors(tmp_path, capsys):
    assert ablate.main(ablate.Args(out_dir=tmp_path, variants=("nope",))) == 2
    assert "unknown variant(s) nope; known: baseline" in capsys.readouterr().err
    (tmp_path / "ablation.json").write_text(json.dumps({"steps": 1}))
    assert ablate.main(ablate.Args(out_dir=tmp_path, variants=("baseline",))) == 2
    assert "holds an ablation with other settings" in capsys.readouterr().err


def test_results_table_marks_missing_and_infinite_figures():
    name = "baseline"
    results = {
        "settings": ablate.settings(ablate.Args()),
        "variants": {
            name: {
                "overrides": {},
                "command": "python -m experiments.pretrain",
                "eval_loss": 1.5,
                "load_cv": 0.2,
                "max_min_ratio": float("inf"),
                "dropped_fraction": 0.0,
                "router_entropy": 0.9,
                "domain_nmi": None,
                "tokens_per_second": 100.0,
            }
        },
    }
    table = ablate.results_table(results)
    assert f"| {name} | 1.500 |  | 0.200 | inf | 0.000 | 0.900 | – | 100 |" in table
