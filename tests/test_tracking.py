"""Trackers beside metrics.jsonl: TensorBoard event files and an offline W&B run hold the same scalars; a
tracker that fails mid-run is switched off with one warning and the run finishes; one that cannot start stops
the run with one line."""

import dataclasses
import json
import struct

import numpy as np
import pytest

from eqmoe.train import tracking
from experiments import pretrain
from tests.test_pretrain import _tiny

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
wandb = pytest.importorskip("wandb")


def _records(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_and_offline_wandb_hold_the_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    # 16 steps: the W&B run file (about 40 KB) still spans more than one of its 32 KiB blocks
    args = _tiny(out, steps=16, tracker=("jsonl", "tensorboard", "wandb"))
    run = dataclasses.replace(args.run, eval_every=8, checkpoint_every=16, peak_tflops=0.5)
    pretrain.run(dataclasses.replace(args, run=run))
    records = [r for r in _records(out) if "loss" in r]
    assert [r["step"] for r in records] == list(range(2, 17, 2))
    for r in records:  # the compute rates: model FLOPs per token times tokens/s, over the given peak
        assert r["model_flops_per_token"] == records[0]["model_flops_per_token"] > 0
        assert r["tflops_per_device"] == pytest.approx(r["tokens_per_second"] * r["model_flops_per_token"] / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / 0.5)

    events = event_accumulator.EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    rates = ("tokens_per_second", "mfu", "tflops_per_device", "model_flops_per_token")
    for tag in ("loss", "learning_rate", "grad_norm", *rates, "eval_loss", "load_cv"):
        assert tag in tags, tag
    layers = len(records[0]["load_cv_by_layer"])
    assert {f"load_cv_by_layer/layer_{i:02d}" for i in range(layers)} <= tags
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [r["step"] for r in records]
    np.testing.assert_allclose([e.value for e in loss], [r["loss"] for r in records], rtol=1e-6)
    cv = events.Scalars("load_cv_by_layer/layer_01")
    np.testing.assert_allclose([e.value for e in cv], [r["load_cv_by_layer"][1] for r in records], rtol=1e-6)
    assert "metrics" in events.Tags()["images"]

    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and (out / "wandb_run_id").read_text().strip() in runs[0].name
    history = {int(row["_step"]): row for row in _wandb_history(next(runs[0].glob("*.wandb")))}
    assert sorted(history) == sorted({r["step"] for r in _records(out)})  # training and eval steps
    for r in records:
        row = history[r["step"]]
        assert float(row["loss"]) == pytest.approx(r["loss"], rel=1e-6)
        assert float(row["learning_rate"]) == pytest.approx(r["learning_rate"], rel=1e-6)
        assert float(row["load_cv_by_layer/layer_01"]) == pytest.approx(r["load_cv_by_layer"][1], rel=1e-6)
    evals = [r for r in _records(out) if "eval_loss" in r]
    assert all(float(history[r["step"]]["eval_loss"]) == pytest.approx(r["eval_loss"], rel=1e-6) for r in evals)

    # --resume continues the same W&B run (its id is kept beside the run).
    run_id = (out / "wandb_run_id").read_text().strip()
    more = dataclasses.replace(args.run, steps=18, resume=True, eval_every=8, checkpoint_every=16, tracker=("wandb",))
    pretrain.run(dataclasses.replace(args, run=more))
    assert (out / "wandb_run_id").read_text().strip() == run_id
    resumed = [run for run in (out / "wandb").glob("offline-run-*") if run != runs[0]]
    assert len(resumed) == 1 and resumed[0].name.endswith(run_id)
    assert 18 in {int(row["_step"]) for row in _wandb_history(next(resumed[0].glob("*.wandb")))}


def _wandb_history(path) -> list[dict]:
    """The history rows of an offline W&B run file: LevelDB-style log blocks of 32 KiB after a 7-byte header,
    records of (crc32c, length, type) + data, FULL/FIRST/MIDDLE/LAST pieces, each a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    raw, block, position, pieces, rows = path.read_bytes(), 32768, 7, b"", []
    assert raw[:4] == b":W&B"
    while position + 7 <= len(raw):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", raw[position : position + 7])
        if left < 7 or (kind == 0 and length == 0):  # the rest of the block is padding
            position += left
            continue
        pieces += raw[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    return rows


def test_a_tracker_failing_mid_run_is_switched_off_and_the_run_finishes(tmp_path, monkeypatch, capsys):
    calls = []
    real = tracking.TensorBoard.scalars

    def flaky(self, step, values):
        calls.append(step)
        if len(calls) == 3:
            raise OSError("disk full")
        real(self, step, values)

    monkeypatch.setattr(tracking.TensorBoard, "scalars", flaky)
    out = tmp_path / "run"
    pretrain.run(_tiny(out, steps=8, tracker=("tensorboard",)))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "tracker tensorboard failed" in line]
    assert len(warnings) == 1 and "disk full" in warnings[0]
    assert len(calls) == 3  # switched off after the failure
    assert [r["step"] for r in _records(out) if "loss" in r] == [2, 4, 6, 8]  # metrics.jsonl is complete
    assert (out / "summary.json").is_file()


def test_a_tracker_that_cannot_start_is_one_line_and_no_step(tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise PermissionError("cannot write tensorboard/")

    monkeypatch.setattr(tracking.TensorBoard, "__init__", refuse)
    out = tmp_path / "run"
    assert pretrain.main(_tiny(out, steps=4, tracker=("tensorboard",))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("pretrain: --tracker tensorboard: could not start (PermissionError")
    assert not (out / "metrics.jsonl").exists() or not _records(out)
