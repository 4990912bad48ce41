"""A step that does not fit the device stops in one line before anything is written; ``--remat auto`` takes the least
recomputation that fits; the remat policies compute the same step; MFU peaks by device kind."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tyro

from eqmoe import flops, presets
from eqmoe.train import memory_fit
from eqmoe.train.optimizer import OptimizerConfig, make_optimizer, trained_roles
from eqmoe.train.state import init_state
from eqmoe.train.step import Batch, make_train_step
from experiments import pretrain

ROWS, SEQ = 8, 64


def _state_and_step(remat: str, **changes):
    import equinox as eqx

    from eqmoe.model import Transformer

    config = presets.get("qwen3-moe-micro").replace(remat=remat, **changes)
    model = Transformer(config, key=jax.random.key(0))
    params = eqx.filter(model, eqx.is_array)
    optimizer, schedule = make_optimizer(OptimizerConfig(), params, embed_dim=config.embed_dim)
    state = init_state(model, optimizer, key=jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (ROWS, SEQ), 0, config.vocab_size)
    batch = Batch(
        tokens=tokens,
        segment_ids=jnp.ones((ROWS, SEQ), jnp.int32),
        positions=jnp.broadcast_to(jnp.arange(SEQ, dtype=jnp.int32), (ROWS, SEQ)),
        target_mask=jnp.ones((ROWS, SEQ), bool).at[:, 0].set(False),
    )
    return (
        state,
        batch,
        optimizer,
        lambda: make_train_step(optimizer, schedule, trained_roles(OptimizerConfig(), params)),
    )


def test_every_remat_policy_computes_the_same_step():
    losses, grads = {}, {}
    for remat in ("none", "dots", "offload", "block"):
        state, batch, _, make_step = _state_and_step(remat)
        new_state, terms = make_step()(batch, state)
        losses[remat] = float(terms["loss"])
        grads[remat] = jax.tree.leaves(new_state.model)[0]
    for remat in ("dots", "offload", "block"):
        assert losses[remat] == pytest.approx(losses["none"], rel=1e-6)
        np.testing.assert_allclose(grads[remat], grads["none"], rtol=1e-5, atol=1e-7)


def _needs() -> dict[str, float]:
    needs = {}
    for remat in ("none", "block"):
        state, batch, _, make_step = _state_and_step(remat)
        needs[remat] = memory_fit.compile_step(make_step(), batch, state)[1].total
    return needs


def test_policies_compiled_side_by_side_hold_what_they_hold_one_at_a_time(monkeypatch):
    trials, make_step, batch = {}, None, None
    for remat in ("none", "block"):
        trials[remat], batch, _, make_step = _state_and_step(remat)
    monkeypatch.setattr(memory_fit.os, "cpu_count", lambda: 1)  # in turn, up to the first that fits
    assert list(memory_fit.compile_steps(make_step, batch, trials, lambda step, need: True)) == ["none"]
    in_turn = memory_fit.compile_steps(make_step, batch, trials, lambda step, need: False)
    monkeypatch.setattr(memory_fit.os, "cpu_count", lambda: 8)  # every one, on threads
    side_by_side = memory_fit.compile_steps(make_step, batch, trials, lambda step, need: True)
    assert {name: need for name, (_, need) in side_by_side.items()} == {
        name: need for name, (_, need) in in_turn.items()
    }
    step, _ = side_by_side["block"]
    _, terms = step(batch, trials["block"])
    assert np.isfinite(float(terms["loss"]))


def _pretrain_args(out_dir, *extra):
    argv = ["--out-dir", str(out_dir), "--steps", "2", "--seq-len", str(SEQ), "--batch-size", str(ROWS)]
    argv += ["--chars-per-domain", "3000", "--eval-chars-per-domain", "800", "--log-every", "1", *extra]
    return tyro.cli(pretrain.Args, args=argv, config=(tyro.conf.OmitArgPrefixes,))


def test_a_step_that_does_not_fit_is_one_line_naming_a_setting_that_fits_and_writes_nothing(tmp_path, capsys):
    needs = _needs()
    assert needs["block"] < needs["none"]
    limit_gib = (needs["block"] / memory_fit.HEADROOM + needs["none"]) / 2 / 2**30  # block fits, none does not
    out = tmp_path / "run"
    assert pretrain.main(_pretrain_args(out, "--device-memory-gib", f"{limit_gib:.6f}")) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pretrain:")]
    assert len(err) == 1, err
    assert "the train step needs" in err[0] and f"the device has {limit_gib:.2f} GiB" in err[0]
    assert "fits: --remat block" in err[0] or "fits: --remat dots" in err[0] or "fits: --remat offload" in err[0]
    assert not out.exists()  # nothing written

    assert pretrain.main(_pretrain_args(out, "--device-memory-gib", f"{limit_gib:.6f}", "--remat", "auto")) == 0
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("auto remat ->"))
    assert "'none'" not in line.split("(")[0] and "none " in line  # none was compiled, and not taken
    assert (out / "metrics.jsonl").is_file()


def test_a_step_whose_logits_do_not_fit_is_told_to_take_the_output_layer_in_chunks(tmp_path, capsys):
    # a vocabulary of 16,384 at 8 x 64 tokens: float32 logits and their gradient (67 MB) are most of the step
    needs = {}
    for chunk in (0, SEQ // 8):
        state, batch, _, make_step = _state_and_step("none", vocab_size=16384, output_chunk=chunk)
        needs[chunk] = memory_fit.compile_step(make_step(), batch, state)[1].total
    assert needs[SEQ // 8] < needs[0] / 1.5
    limit_gib = (needs[SEQ // 8] / memory_fit.HEADROOM + needs[0]) / 2 / 2**30
    out = tmp_path / "run"
    wide = ("--device-memory-gib", f"{limit_gib:.6f}", "--override", "vocab_size=16384")
    assert pretrain.main(_pretrain_args(out, *wide)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pretrain:")]
    assert len(err) == 1 and f"--override output_chunk={SEQ // 8} (" in err[0], err
    assert not out.exists()
    assert pretrain.main(_pretrain_args(out, *wide, f"output_chunk={SEQ // 8}")) == 0  # as it said: it fits
    assert (out / "metrics.jsonl").is_file()


def test_mfu_is_taken_against_the_device_kinds_specified_peak():
    assert flops.specified_peak_tflops("TPU v5 lite", "bfloat16") == 197.0
    assert flops.specified_peak_tflops("TPU v5 lite", "float32") == 197.0  # float32 products run as bf16 passes
    assert flops.specified_peak_tflops("TPU v6 lite", "bfloat16") == 918.0
    assert flops.specified_peak_tflops("NVIDIA H100 80GB HBM3", "float32") == 495.0
    assert flops.specified_peak_tflops("cpu", "float32") is None
    peak, source = flops.device_peak_tflops("float32")  # a CPU: measured
    assert peak > 0 and "measured" in source
