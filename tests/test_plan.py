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


# XLA's compiled bytes (arguments + temporaries) of these --remat block steps on one TPU v5e chip (2026-12-07, jax
# 0.10.2, `experiments/tpu_check.sh plan`): 8 x 1024 tokens, bfloat16, embed 1024, heads of 128, experts of 512, a
# vocabulary of 32,000. The sum XLA:CPU nearly keeps was 1.46-1.66x these.
CHIP_BLOCK_GIB = {"qwen3-moe-tiny": 3.117, "envy-test": 2.436, "deepseek-v3-micro": 2.911}


@pytest.mark.parametrize("preset", sorted(CHIP_BLOCK_GIB))
def test_block_remat_estimate_for_a_tpu_is_within_15_percent_of_the_chips_compiled_bytes(preset):
    from eqmoe.config_io import apply_overrides

    widths = {"embed_dim": 1024, "attention.head_dim": 128, "vocab_size": 32000, "moe.expert_dim": 512}
    config = apply_overrides(presets.get(preset), widths)
    config = config.replace(remat="block", dtype="bfloat16", param_dtype="float32")
    estimate = plan.estimate(config, _one_device(), 8, 1024, platform="tpu")
    assert estimate.peak == pytest.approx(CHIP_BLOCK_GIB[preset] * 2**30, rel=0.15)
    # the same step as XLA:CPU lays it out: everything at once
    assert plan.estimate(config, _one_device(), 8, 1024, platform="cpu").peak > 1.4 * estimate.peak


def test_chunked_output_layer_estimate_agrees_with_xla_within_15_percent():
    """A vocabulary of 32,000 at 16 x 128 tokens: the whole sequence's float32 logits and gradient (about 250 MiB of
    the compiled 620) against one chunk of 32 positions (XLA:CPU: 623 -> 252 MiB compiled)."""
    config = presets.get("qwen3-moe-micro").replace(vocab_size=32_000, output_chunk=32)
    p = _one_device()
    estimate, compiled = plan.estimate(config, p, 16, 128), plan.compile_step(config, p, 16, 128)
    assert estimate.peak == pytest.approx(compiled.argument + compiled.temp, rel=0.15)
    whole = plan.estimate(config.replace(output_chunk=0), p, 16, 128)
    assert whole.peak - estimate.peak == pytest.approx(4 * 2 * 32_000 * 16 * (128 - 32))


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


# --- hybrid linear attention (Qwen3-Next) -------------------------------------------------------------------------


def _tiny_hybrid():
    """Qwen3-Next's layout at toy widths: three gated DeltaNet layers (scanned), then full attention."""
    from eqmoe.config import LinearAttentionConfig
    from eqmoe.config_io import apply_overrides
    from eqmoe.models.qwen3_next import hybrid

    linear = LinearAttentionConfig(key_heads=2, value_heads=4, key_head_dim=16, value_head_dim=16, projection="grouped")
    config = hybrid(
        vocab=128, embed=64, layers=4, heads=2, kv_heads=1, head_dim=32, linear=linear, experts=4, top_k=2,
        expert_dim=32, shared_dim=32, mlp_dim=None, theta=1e4, family="qwen3_next",
    )  # fmt: skip
    return apply_overrides(config.replace(dtype="float32", param_dtype="float32"), {"attention.backend": "blockwise"})


def test_hybrid_decoding_cache_grows_only_through_its_full_attention_layers():
    """Qwen3-Next-80B: 12 full-attention layers keep keys and values per token, 36 linear layers a convolution window
    and a float32 state per sequence; doubling the length doubles only the keys and values."""
    config = presets.get("qwen3-next-80b-a3b").replace(dtype="bfloat16")
    linear = config.attention.linear
    kv_per_token = 12 * 2 * 2 * 2 * 256  # layers x (keys, values) x kv heads x bf16 bytes x head_dim
    state = 36 * (2 * (linear.conv_kernel - 1) * linear.conv_channels + 4 * 32 * 128 * 128)
    short, long = plan.decoding_cache(config, 4096), plan.decoding_cache(config, 8192)
    assert (short.per_token, short.state, short.growing_layers, short.state_layers) == (kv_per_token, state, 12, 36)
    assert (long.per_token, long.state) == (short.per_token, short.state)
    assert long.total - long.state == 2 * (short.total - short.state)
    assert long.total == short.total + 4096 * kv_per_token
    assert plan.cache_bytes_per_token(config) == (kv_per_token, kv_per_token)  # the state is no per-token figure
    assert state == 77_266_944  # 2.1 MB per linear layer and sequence, whatever its length


def test_hybrid_activations_are_linear_in_length_and_its_flops_independent_of_it():
    config = presets.get("qwen3-next-80b-a3b").replace(dtype="bfloat16")
    linear_layers = [i for i, layer in enumerate(config.layers) if layer.attention == "gated_deltanet"]
    assert len(linear_layers) == 36
    costs = {seq: plan.layer_costs(config, plan.PlanShape(1, seq, 2)) for seq in (4096, 8192, 32768)}
    for i in linear_layers:
        attention = [costs[seq][i][0] for seq in costs]
        assert len({(c.activations, c.flops, c.cache, c.state) for c in attention}) == 1  # per token: no length in it
        assert attention[0].cache == 0 and attention[0].state > 0
        # once per step: the chunked cotangents, per token, and one chunk's [C, C] matrices
        assert [c.per_step for c in attention] == pytest.approx(
            [attention[0].per_step * seq / 4096 for seq in costs], rel=0.01
        )
    p = _one_device()
    one, two, four = (plan.estimate(config, p, 1, seq).activations for seq in (4096, 8192, 16384))
    # affine in the length, no quadratic term (what does not grow: the MoE dispatch's padding blocks, the blockwise
    # attention's [rows, H, B, B] tile, the chunk's [C, C] matrices)
    assert four - two == pytest.approx(2 * (two - one), rel=1e-9)


def test_linear_attention_forward_flops_are_what_xla_counts_for_one_chunk():
    """The planner's count, a quarter of its training FLOPs, against XLA's cost analysis of the chunked delta rule
    on one chunk of one head (the scan's body runs once, so XLA counts it exactly): within 5% (XLA also counts the
    element-wise work, the decays and masks, that the analytic count leaves out)."""
    import jax
    import jax.numpy as jnp

    from eqmoe.config import LinearAttentionConfig
    from eqmoe.nn.delta_rule import chunked_delta_rule
    from eqmoe.nn.gated_deltanet import GatedDeltaNet

    linear = LinearAttentionConfig(key_heads=1, value_heads=1, key_head_dim=128, value_head_dim=128)
    base = presets.get("qwen3-next-80b-a3b")
    config = base.replace(attention=dataclasses.replace(base.attention, linear=linear))
    chunk = linear.chunk_size
    cost = GatedDeltaNet.plan(config, config.layers[0], plan.PlanShape(1, chunk, 4))
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    args = (f32(1, chunk, 1, 128), f32(1, chunk, 1, 128), f32(1, chunk, 1, 128), f32(1, chunk, 1), f32(1, chunk, 1))
    # a given incoming state: a zero one would let XLA drop its products
    rule = lambda *x: chunked_delta_rule(*x[:5], initial_state=x[5], chunk_size=chunk)  # noqa: E731
    compiled = jax.jit(rule).lower(*args, f32(1, 1, 128, 128)).compile()
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list | tuple) else analysis
    assert cost.flops / 4 * chunk == pytest.approx(analysis["flops"], rel=0.05)


# -m slow (15 s: compiles a hybrid model's train step): the linear kind's terms are the two tests above, its FLOPs
# checked against XLA's, the planner's machinery against XLA by test_train_step_memory_is_linear_in_sequence_length
@pytest.mark.slow
def test_hybrid_estimate_agrees_with_xla_within_15_percent():
    """The gated DeltaNet layers' activations, calibrated as the other kinds' on XLA:CPU."""
    config, p = _tiny_hybrid(), _one_device()
    estimate = plan.estimate(config, p, 16, 128)
    compiled = plan.compile_step(config, p, 16, 128)
    assert estimate.argument == pytest.approx(compiled.argument, rel=0.01)
    assert estimate.peak == pytest.approx(compiled.argument + compiled.temp, rel=0.15)


def test_plan_cli_plans_qwen3_next_with_its_recurrent_state(capsys):
    args = plan_cli.Args(preset="qwen3-next-80b-a3b", seq_len=4096, batch_size=1, dtype="bfloat16", compile=False)
    assert plan_cli.main(args) == 0
    out = capsys.readouterr().out
    assert "decoding cache 24,576 bytes/token in 12 layers + 77,266,944 bytes/sequence of recurrent state" in out, out
    assert plan_cli.main(dataclasses.replace(args, json=True)) == 0
    [row] = json.loads(capsys.readouterr().out)
    cache = row["decoding_cache"]
    assert cache["bytes_per_sequence"] == 4096 * 24_576 + 77_266_944 and cache["state_layers"] == 36
    assert row["cache_bytes_per_token"] == {"kept": 24_576, "expanded": 24_576}
