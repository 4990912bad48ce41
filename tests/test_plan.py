"""Planning: the analytic memory estimate against XLA's compiled figures, remat's direction, the CLI."""

import dataclasses
import json

import pytest

from eqmoe import parallel, presets
from eqmoe.analysis import plan
from experiments import plan as plan_cli


def _one_device():
    import jax

    return parallel.make_parallelism("data=1", devices=jax.devices()[:1])


@pytest.mark.parametrize(
    ("preset", "remat"),
    [("qwen3-moe-micro", "none"), ("qwen3-moe-micro", "block"), ("envy-test", "none")]
    + [pytest.param("qwen3-moe-tiny", "none", marks=pytest.mark.slow)],  # micro's formulas at other sizes
)
def test_analytic_estimate_agrees_with_xla_within_15_percent(preset, remat):
    config = presets.get(preset).replace(remat=remat)
    p = _one_device()
    estimate = plan.estimate(config, p, 16, 128)
    compiled = plan.compile_step(config, p, 16, 128)
    assert estimate.argument == pytest.approx(compiled.argument, rel=0.01)
    assert estimate.output == pytest.approx(compiled.output, rel=0.01)
    assert estimate.peak == pytest.approx(compiled.argument + compiled.temp, rel=0.15)


def test_block_remat_lowers_the_temporary_bytes():
    p = _one_device()
    config = presets.get("qwen3-moe-micro")
    none = plan.compile_step(config.replace(remat="none"), p, 16, 128)
    block = plan.compile_step(config.replace(remat="block"), p, 16, 128)
    assert block.temp < 0.6 * none.temp and block.argument == none.argument
    assert plan.estimate(config.replace(remat="block"), p, 16, 128).temp < plan.estimate(config, p, 16, 128).temp


def test_active_parameters_count_only_the_chosen_experts():
    config = presets.get("qwen3-moe-micro")
    total, active = plan.active_parameters(config)
    moe = config.moe
    unused = config.num_layers * 3 * config.embed_dim * moe.expert_dim * (moe.router.num_experts - moe.router.top_k)
    assert active == total - config.vocab_size * config.embed_dim - unused
    all_params, active_flops = plan.flops_per_token(config, 128)
    assert active_flops < all_params


def test_plan_cli_prints_json_and_reports_bad_meshes_in_one_line(capsys):
    assert plan_cli.main(plan_cli.Args(preset="qwen3-moe-micro", remats=("none", "block"), json=True)) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["remat"] for r in rows] == ["none", "block"] and rows[0]["compiled"]["temp"] > rows[1]["compiled"]["temp"]
    assert plan_cli.main(plan_cli.Args(meshes=("data=3,pipeline=2",), compile=False)) == 2
    assert "plan: mesh spec 'data=3,pipeline=2'" in capsys.readouterr().err


def test_train_step_memory_is_linear_in_sequence_length():
    """Blockwise attention: 4x the tokens of one row, at most ~4x XLA's temporaries (no [seq, seq] scores);
    the analytic estimate follows within 15%."""
    config, p = presets.get("qwen3-moe-tiny"), _one_device()
    short, long = (plan.compile_step(config, p, 1, seq) for seq in (2048, 8192))
    assert long.temp <= 4.5 * short.temp, (short.temp, long.temp)
    assert plan.estimate(config, p, 1, 8192).temp == pytest.approx(long.temp, rel=0.15)


def test_plan_says_whether_a_step_fits_one_device(capsys):
    """gpt-oss-120b with LoRA, its frozen base held in bfloat16 (217.6 GiB): no 80 GiB device holds it; the micro
    preset fits."""
    args = plan_cli.Args(
        preset="gpt-oss-120b", lora_rank=16, dtype="bfloat16", seq_len=256, batch_size=1, compile=False
    )
    assert plan_cli.main(dataclasses.replace(args, device_gib=80.0)) == 0
    out = capsys.readouterr().out
    assert "fits in 80 GiB per device: analytic no (" in out, out
    assert plan_cli.main(dataclasses.replace(args, preset="qwen3-moe-micro", device_gib=80.0, json=True)) == 0
    fits = json.loads(capsys.readouterr().out)[0]["fits"]
    assert fits == {"device_gib": 80.0, "analytic": True, "compiled": None}
