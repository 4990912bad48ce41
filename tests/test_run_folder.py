"""A run folder is never overwritten by accident; ``--resume`` alone replays the run's stored arguments; a damaged
latest checkpoint is set aside and the run continues from the step before, to the uninterrupted run's loss. The
runs take their steps from ``--epochs`` and accumulate two micro-batches a step, which the resume replays exactly."""

import json
import os
import shutil

import pytest
import tyro

from experiments import pretrain, sft

# Settings far from sft's defaults, so that a resume that did not replay them would train something else.
FLAGS = [
    "--seq-len=64",
    "--batch-size=4",
    "--train-examples=300",
    "--eval-examples=12",
    "--checkpoint-every=4",
    "--eval-every=100",
    "--log-every=2",
    "--samples=0",
    "--seed=3",
    "--learning-rate=2e-3",
    "--warmup-steps=2",
    "--grad-accum=2",  # 2 micro-batches of 4 rows a step
    "--epochs=0.2",  # of 300 rows: 60 rows, 8 steps of 8 rows
]


def _parse(*words) -> sft.Args:
    return tyro.cli(sft.Args, args=[str(w) for w in words], config=(tyro.conf.OmitArgPrefixes,))


def _snapshot(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """An uninterrupted 8-step run (checkpoints at steps 4 and 8) and its summary."""
    out = tmp_path_factory.mktemp("runs") / "straight"
    assert sft.main(_parse(*FLAGS, f"--out-dir={out}")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8 and (out / "checkpoints" / "8").is_dir()
    return out, summary


def test_a_new_run_into_a_run_folder_is_refused_and_leaves_it_byte_identical(finished, capsys):
    out, _ = finished
    before = _snapshot(out)
    capsys.readouterr()
    assert sft.main(_parse("--steps=2", f"--out-dir={out}")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a run" in err[0] and "--resume" in err[0] and "--overwrite" in err[0]
    assert _snapshot(out) == before
    assert pretrain.main(pretrain.Args(run=pretrain.RunOptions(steps=2, out_dir=out))) == 2
    assert _snapshot(out) == before


def test_resume_alone_replays_the_arguments_and_steps_over_a_damaged_checkpoint(finished, tmp_path, capsys):
    out, straight = finished
    run = tmp_path / "run"
    shutil.copytree(out, run)
    (run / "summary.json").unlink()
    step_8 = run / "checkpoints" / "8"
    largest = max((p for p in step_8.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    os.truncate(largest, largest.stat().st_size // 2)  # as a full disk or a copy cut short leaves it
    capsys.readouterr()

    assert sft.main(_parse(f"--out-dir={run}", "--resume")) == 0
    err = capsys.readouterr().err
    damaged = [line for line in err.splitlines() if "damaged" in line]
    assert len(damaged) == 1 and "step 8" in damaged[0], err[-2000:]
    assert "resumed from step 4" in err and "Traceback" not in err
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["final_loss"] == straight["final_loss"]
    assert resumed["args"] == straight["args"] | {
        "run": straight["args"]["run"] | {"resume": True, "out_dir": str(run)}
    }
    assert (run / "checkpoints-set-aside" / "8").is_dir()  # moved aside, not deleted
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [4, 8]


def test_resume_refuses_a_setting_that_may_not_change_and_takes_one_that_may(finished, tmp_path, capsys):
    out, _ = finished
    run = tmp_path / "run"
    shutil.copytree(out, run)
    capsys.readouterr()
    assert sft.main(_parse(f"--out-dir={run}", "--resume", "--seed=5", "--lora-rank=4")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--seed 5 (the run's: 3)" in err[0] and "--lora-rank 4 (the run's: None)" in err[0]
    args = sft.replay_stored_arguments(
        _parse(f"--out-dir={run}", "--resume", "--steps=12", "--remat=block"), sft.Args()
    )
    assert (args.run.steps, args.model.remat, args.run.seed, args.data.batch_size) == (12, "block", 3, 4)
    assert args.optim.learning_rate == 2e-3


@pytest.mark.parametrize("zero_refused", [False, True])
def test_of_several_processes_only_process_zero_looks_at_the_folder(tmp_path, monkeypatch, zero_refused):
    """Process 1 may look after process 0 has begun to write: it must neither take those outputs for an earlier
    run's nor remove them under --overwrite, and it refuses exactly when process 0 does."""
    import jax

    from eqmoe import parallel
    from eqmoe.train.loop import RunOptions

    (tmp_path / "arguments.json").write_text('{"written": "by process 0 of this run"}')
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(parallel, "from_process_zero", lambda flag: zero_refused)
    for overwrite in (False, True):
        options = RunOptions(out_dir=tmp_path, overwrite=overwrite)
        if zero_refused:
            with pytest.raises(FileExistsError, match="process 0 refused it"):
                options.claim_out_dir()
        else:
            options.claim_out_dir()
        assert (tmp_path / "arguments.json").read_text() == '{"written": "by process 0 of this run"}'
