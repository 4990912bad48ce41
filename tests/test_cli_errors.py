"""Every experiment turns an expected failure into one line on stderr and exit code 2; a bug keeps its traceback."""

import errno
import importlib

import pytest
import tyro

from experiments._cli import guarded

CASES = [
    ("sft", ["--data", "{tmp}/missing.jsonl", "--steps", "1"], "missing.jsonl"),
    ("sft", ["--steps", "-3"], "--steps=-3 is invalid"),
    ("sft", ["--out-dir", "/sys/eqmoe-run", "--steps", "1", "--train-examples", "20"], "/sys/eqmoe-run"),
    ("pretrain", ["--data", "{tmp}/missing.txt"], "missing.txt: data file not found"),
    ("pretrain", ["--override", "moe.router.top_k=0"], "top_k=0"),
    ("pretrain", ["--mesh", "data=3"], "mesh spec 'data=3'"),
    ("pretrain", ["--dispatch", "fast"], "--dispatch: MoEConfig.dispatch='fast' is invalid"),
    ("ablate", ["--variants", "nope"], "unknown variant(s) nope"),
    ("convert", ["--hf", "{tmp}/missing", "--out", "{tmp}/out"], "missing"),
    ("generate", ["--hf", "{tmp}/missing", "--prompt", "hi"], "missing"),
    ("plan", ["--meshes", "data=3,pipeline=2", "--no-compile"], "plan: mesh spec"),
]


@pytest.mark.parametrize(("name", "argv", "expected"), CASES, ids=[f"{c[0]}:{c[2][:20]}" for c in CASES])
def test_expected_failures_are_one_line_and_exit_2(name, argv, expected, tmp_path, capsys, monkeypatch):
    # Default output folders (runs/sft, ...) are relative: run in an empty folder, so that a run the quickstart left
    # in the checkout does not answer first ("already holds a run").
    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(f"experiments.{name}")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    config = (tyro.conf.OmitArgPrefixes,) if name in ("sft", "pretrain") else ()
    args = tyro.cli(module.Args, args=argv, config=config)
    assert module.main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith(f"{name}:")]
    assert len(err) == 1 and expected.replace("{tmp}", str(tmp_path)) in err[0], err


def test_a_full_disk_is_one_line(tmp_path, monkeypatch, capsys):
    from eqmoe.train import logging
    from experiments import sft

    def full(self, record):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    monkeypatch.setattr(logging.MetricsLog, "write", full)
    argv = ["--out-dir", str(tmp_path), "--steps", "2", "--train-examples", "20", "--eval-examples", "4"]
    args = tyro.cli(sft.Args, args=[*argv, "--log-every", "1"], config=(tyro.conf.OmitArgPrefixes,))
    assert sft.main(args) == 2
    assert "No space left on device" in capsys.readouterr().err


def test_a_bug_keeps_its_traceback():
    def broken(_):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        guarded("demo", broken, None)
