"""The whole-model benchmark against transformers, on a tiny shape: rows, passes, breakdown and JSON; the MoE
layer benchmark's dtype; the GPU script's syntax."""

import functools
import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from experiments import _bench_components, _bench_device, _bench_rows, bench_model, bench_moe

pytest.importorskip("torch")
pytest.importorskip("transformers")

TINY = dict(layers=1, embed=32, heads=2, kv_heads=1, head_dim=16, experts=4, top_k=2, expert_dim=32, vocab=64)
# the Shape fields a row leaves at their defaults unless its family has them
UNSET = dict(window=None, linear_heads=None, latent=None, groups=None, shared_experts=0, dense_layers=0)


@pytest.fixture(autouse=True)
def _no_settling(monkeypatch):
    """The idle quarter second after every timed call on the CPU (SETTLE_S) and the 0.08 s matmul calls steady the
    figures on a busy machine; these tests read no figure's size, only that each is there and positive, so they run
    without them (the tiny run: 30 s -> 10 s, most of it the pauses)."""
    monkeypatch.setattr(bench_model, "SETTLE_S", 0.0)
    monkeypatch.setattr(_bench_components, "interleaved", functools.partial(_bench_device.interleaved, settle_s=0.0))
    monkeypatch.setattr(_bench_device, "CALL_SECONDS", 0.01)


def test_tiny_run_writes_every_row_pass_and_component(tmp_path):
    out = tmp_path / "bench.json"
    args = bench_model.Args(
        shape=("small",), **TINY, batch_size=2, seq_len=16, repeats=1, breakdown=True, json_out=out, peak_size=256
    )
    assert bench_model.main(args) == 0
    results = json.loads(out.read_text())
    peak = results["machine"]["matmul_peak_gflops"]
    assert peak > 0
    for row in results["rows"]:  # model FLOPs over the median time, and that over the measured peak
        assert row["eqmoe_gflops"] == pytest.approx(row["model_gflop"] / row["eqmoe_ms"] * 1e3)
        assert row["eqmoe_of_peak"] == pytest.approx(row["eqmoe_gflops"] / peak)
        assert row["hf_of_peak"] == pytest.approx(row["model_gflop"] / row["hf_ms"] * 1e3 / peak)
    forward, train = results["rows"]
    assert train["model_gflop"] == pytest.approx(3 * forward["model_gflop"])

    assert results["machine"]["cpu_count"] >= 1 and results["machine"]["jax_backend"]
    assert [(r["shape"], r["pass"]) for r in results["rows"]] == [("small", "forward"), ("small", "train")]
    for row in results["rows"]:
        assert row["config"] == {**TINY, **UNSET, "batch": 2, "seq": 16, "family": "qwen3_moe"}
        assert row["logit_max_abs_diff"] < 1e-3
        for field in ("eqmoe_ms", "hf_ms", "eqmoe_tokens_per_s", "hf_tokens_per_s", "eqmoe_compile_s"):
            assert row[field] > 0, field
        assert row["hf_first_call_s"] > 0 and math.isfinite(row["ratio"]) and row["ratio"] > 0
        assert row["ratio"] == pytest.approx(row["eqmoe_tokens_per_s"] / row["hf_tokens_per_s"])
        # 2 x 16 tokens top-2 over 4 experts: 16 rows each, [16 x 32] @ [32 x 64] (gate and up, 32 wide each)
        assert row["expert_matmul"]["shape"] == [16, 32, 64]
        assert row["expert_matmul"]["jnp_dot_gflops"] > 0 and row["expert_matmul"]["torch_mm_gflops"] > 0
    square = results["machine"]["square_matmul"]
    assert square["jnp_dot_gflops"] > 0 and square["torch_mm_gflops"] > 0

    names = {entry["component"] for entry in results["breakdown"]}
    assert names == {"attention", "moe", "dense_swiglu_64", "rmsnorm", "embed_head_loss"}
    assert len(results["breakdown"]) == 2 * len(names)
    for entry in results["breakdown"]:
        assert entry["eqmoe_ms"] > 0 and entry["hf_ms"] > 0 and math.isfinite(entry["ratio"])
        assert entry["max_abs_diff"] < 1e-4, entry  # the same weights compute the same component
    assert results["sliding_over_full"] == [] and results["linear_scaling"] == []  # every layer attends fully


# -m slow (32 s): the bench's machinery is the Qwen row's test above; gpt-oss's numbers are tests/test_gpt_oss.py's and
# the sliding kernel's tests/test_attention.py's
@pytest.mark.slow
def test_gpt_oss_row_times_its_sliding_and_full_attention_apart(tmp_path):
    out = tmp_path / "bench.json"
    shape = dict(TINY, layers=2)  # one sliding layer, one full
    args = bench_model.Args(
        shape=("gpt-oss-forward",),
        **shape,
        window=16,
        batch_size=1,
        seq_len=64,
        repeats=1,
        breakdown=True,
        json_out=out,
    )
    assert bench_model.main(args) == 0
    results = json.loads(out.read_text())

    assert [(r["shape"], r["pass"]) for r in results["rows"]] == [("gpt-oss", "forward")]
    for row in results["rows"]:
        assert row["config"] == {**shape, **UNSET, "batch": 1, "seq": 64, "family": "gpt_oss", "window": 16}
        assert row["logit_max_abs_diff"] < 1e-3 and row["eqmoe_ms"] > 0 and row["hf_ms"] > 0

    by_name = {(entry["component"], entry["pass"]): entry for entry in results["breakdown"]}
    for name in ("attention_sliding", "attention_full"):
        for pass_name in ("forward", "fwd+bwd"):
            entry = by_name[name, pass_name]
            assert entry["eqmoe_ms"] > 0 and entry["hf_ms"] > 0 and entry["max_abs_diff"] < 1e-4, entry
    assert ("attention", "forward") not in by_name
    [ratio] = results["sliding_over_full"]
    assert ratio["shape"] == "gpt-oss" and ratio["window"] == 16 and ratio["seq"] == 64
    sliding, full = by_name["attention_sliding", "forward"], by_name["attention_full", "forward"]
    assert ratio["eqmoe_forward"] == pytest.approx(sliding["eqmoe_ms"] / full["eqmoe_ms"])
    assert all(math.isfinite(ratio[f"{side}_{p}"]) for side in ("eqmoe", "hf") for p in ("forward", "fwd+bwd"))


def test_the_sliding_layer_sees_its_window_and_no_further():
    """The breakdown's transformers side gets the mask transformers builds for each layer; a wrong one would show
    only as a timing, so pin it: a sliding layer's query q sees keys q - W < k <= q."""
    import torch

    shape = bench_model.Shape(**dict(TINY, layers=2), batch=1, seq=8, family="gpt_oss", window=3)
    reference, model = bench_model.build_models(shape, seed=0)
    assert _bench_components.attention_layers(model.config) == {"attention_sliding": 0, "attention_full": 1}
    x, x_t = np.zeros((1, 8, TINY["embed"]), np.float32), torch.zeros(1, 8, TINY["embed"])
    masks = {
        name: _bench_components.attention_component(name, index, shape, model, reference, x, x_t).their_const[1]
        for name, index in _bench_components.attention_layers(model.config).items()
    }
    q, k = np.arange(8)[:, None], np.arange(8)[None, :]
    assert np.array_equal(masks["attention_sliding"][0, 0].numpy() == 0, (k <= q) & (k > q - 3))
    assert np.array_equal(masks["attention_full"][0, 0].numpy() == 0, k <= q)


def test_shape_selection_and_overrides():
    rows = bench_model.selected_rows(bench_model.Args(shape=("wide-train", "small", "wide-forward"), seq_len=64))
    both = ("forward", "train")
    assert [(name, passes) for name, _, passes in rows] == [("wide", both), ("small", both)]
    assert all(shape.seq == 64 for _, shape, _ in rows)
    # gpt-oss's 1 x 8,192 row (12 minutes here) and qwen3-next's run when asked for
    defaults = ["small", "wide", "long", "fine", "deepseek"]
    assert [name for name, _, _ in bench_model.selected_rows(bench_model.Args())] == defaults
    [(name, shape, passes)] = bench_model.selected_rows(bench_model.Args(shape=("qwen3-next-train",)))
    assert (name, passes, shape.family, shape.linear_heads) == ("qwen3-next", ("train",), "qwen3_next", (2, 4))
    assert bench_model.main(bench_model.Args(shape=("huge",))) == 2

    [(name, shape, passes)] = bench_model.selected_rows(bench_model.Args(shape=("gpt-oss-train",), window=64))
    assert (name, passes, shape.family, shape.window) == ("gpt-oss", ("train",), "gpt_oss", 64)
    assert bench_model.main(bench_model.Args(shape=("gpt-oss-sideways",))) == 2
    assert bench_model.main(bench_model.Args(shape=("small",), window=64)) == 2  # no sliding layers to resize


# -m slow (about 60 s: transformers' torch delta rule, compiling each side): the bench's machinery is the Qwen row's
# test above, the linear layer's sweep test_linear_layer_is_timed_alone_at_each_length, and the numbers
# tests/test_qwen3_next.py's
@pytest.mark.slow
def test_qwen3_next_row_times_its_linear_and_full_attention_apart(tmp_path):
    out = tmp_path / "bench.json"
    shape = dict(TINY, layers=4)  # three linear layers, one full
    args = bench_model.Args(
        shape=("qwen3-next",),
        **shape,
        batch_size=1,
        seq_len=64,
        repeats=1,
        breakdown=True,
        linear_lengths=(64, 128),
        json_out=out,
    )
    assert bench_model.main(args) == 0
    results = json.loads(out.read_text())

    assert [(r["shape"], r["pass"]) for r in results["rows"]] == [("qwen3-next", "forward"), ("qwen3-next", "train")]
    for row in results["rows"]:
        assert row["config"] == {**shape, **UNSET, "batch": 1, "seq": 64, "family": "qwen3_next"} | {
            "linear_heads": [2, 4]
        }
        assert row["logit_max_abs_diff"] < 1e-3 and row["eqmoe_ms"] > 0 and row["hf_ms"] > 0
    by_name = {(entry["component"], entry["pass"]): entry for entry in results["breakdown"]}
    for name in ("attention_linear", "attention_full"):
        for pass_name in ("forward", "fwd+bwd"):
            entry = by_name[name, pass_name]
            assert entry["eqmoe_ms"] > 0 and entry["hf_ms"] > 0 and entry["max_abs_diff"] < 1e-4, entry
    assert [entry["seq"] for entry in results["linear_scaling"]] == [64, 128]


def test_linear_layer_is_timed_alone_at_each_length():
    """The breakdown's sweep of one gated DeltaNet layer: per length its fwd+bwd time per token and XLA's temporary
    bytes, and both per token over the shortest length's."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from eqmoe.config import LinearAttentionConfig
    from eqmoe.model import Transformer
    from eqmoe.models.qwen3_next import hybrid

    linear = LinearAttentionConfig(key_heads=1, value_heads=2, key_head_dim=8, value_head_dim=8, projection="grouped")
    config = hybrid(
        vocab=64, embed=32, layers=4, heads=2, kv_heads=1, head_dim=16, linear=linear, experts=4, top_k=2,
        expert_dim=16, shared_dim=16, mlp_dim=None, theta=1e4, family="qwen3_next",
    ).replace(dtype="float32", param_dtype="float32")  # fmt: skip
    abstract = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))  # building it eagerly takes 10 s
    rng = np.random.default_rng(0)
    model = jax.tree.map(lambda x: jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype), abstract)
    assert _bench_components.attention_layers(config) == {"attention_linear": 0, "attention_full": 3}
    shape = bench_model.Shape(**dict(TINY, layers=4), batch=2, seq=16, family="qwen3_next", linear_heads=(1, 2))
    entries = _bench_components.linear_scaling("qwen3-next", shape, model, (64, 256), repeats=2, seed=0)
    assert [(e["layer"], e["batch"], e["seq"], e["tokens"]) for e in entries] == [(0, 2, 64, 128), (0, 2, 256, 512)]
    for entry in entries:
        assert entry["eqmoe_ms"] > 0 and entry["temp_bytes"] > 0 and entry["compile_s"] > 0
        assert entry["us_per_token"] == pytest.approx(entry["eqmoe_ms"] * 1e3 / entry["tokens"])
        assert entry["temp_bytes_per_token"] == pytest.approx(entry["temp_bytes"] / entry["tokens"])
    assert entries[0]["per_token_over_first"] == 1.0 and entries[0]["temp_per_token_over_first"] == 1.0
    assert entries[1]["temp_per_token_over_first"] < 1.5  # a quadratic term would be 4x here


def test_fine_and_deepseek_rows_have_their_families_proportions():
    fine, deepseek = bench_model.SHAPES["fine"], bench_model.SHAPES["deepseek"]
    # Qwen3-30B-A3B's: 128 experts top-8, a quarter of the model wide
    assert (fine.family, fine.experts, fine.top_k, fine.embed, fine.layers, fine.expert_dim) == (
        "qwen3_moe", 128, 8, 512, 4, 128
    )  # fmt: skip
    assert (fine.batch, fine.seq) == (4, 512)
    # DeepSeek-V3's: 256 experts top-8 among 4 of 8 groups, one shared expert, a dense first layer, latent attention
    assert (deepseek.family, deepseek.experts, deepseek.top_k, deepseek.groups) == ("deepseek_v3", 256, 8, (8, 4))
    assert (deepseek.shared_experts, deepseek.dense_layers, deepseek.embed) == (1, 1, 512)
    assert deepseek.latent is not None and 2 <= deepseek.layers <= 4 and 64 <= deepseek.expert_dim <= 128

    config = _bench_rows._deepseek_v3_config(deepseek)  # as transformers reads it
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_group, config.topk_group) == (256, 8, 8, 4)
    assert (config.n_shared_experts, config.first_k_dense_replace, config.norm_topk_prob) == (1, 1, True)
    assert config.routed_scaling_factor == 2.5 and config.moe_intermediate_size == deepseek.expert_dim

    [(_, shape, _)] = bench_model.selected_rows(bench_model.Args(shape=("deepseek",), heads=2, kv_heads=2))
    assert (shape.heads, shape.kv_heads, shape.groups) == (2, 2, (8, 4))
    for wrong in (dict(kv_heads=4), dict(experts=12), dict(experts=16, top_k=12)):
        assert bench_model.main(bench_model.Args(shape=("deepseek",), **wrong)) == 2, wrong


# -m slow (about 30 s): the DeepSeek-V3 model's numbers are tests/test_deepseek.py's, the bench's machinery and closing
# table the Qwen row's test above, --dtype's parsing test_dtype_flag_reaches_both_benchmarks below
@pytest.mark.slow
def test_tiny_deepseek_row_in_bfloat16_against_transformers(tmp_path, capsys):
    """DeepSeek-V3's row end to end (a dense layer, then 16 experts in 8 groups with a shared one): the weights
    checked in float32, both passes timed in bfloat16, and the last table's line."""
    out = tmp_path / "bench.json"
    shape = dict(TINY, layers=2, kv_heads=2, experts=16, top_k=4)
    args = bench_model.Args(
        shape=("deepseek",), **shape, batch_size=2, seq_len=16, repeats=1, dtype="bfloat16", json_out=out,
        peak_size=256,
    )  # fmt: skip
    assert bench_model.main(args) == 0
    results = json.loads(out.read_text())
    assert results["args"]["dtype"] == "bfloat16" and results["machine"]["matmul_peak_gflops"] > 0
    assert [(r["shape"], r["pass"]) for r in results["rows"]] == [("deepseek", "forward"), ("deepseek", "train")]
    for row in results["rows"]:
        assert row["config"]["family"] == "deepseek_v3" and row["config"]["groups"] == [8, 4]
        assert row["logit_max_abs_diff"] < 1e-3  # float32: the same weights
        assert 0 < row["logit_max_abs_diff_bfloat16"] < 0.1
        assert row["eqmoe_tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0 and row["eqmoe_of_peak"] > 0
    printed = capsys.readouterr().out
    forward, train = results["rows"]
    summary = f"{100 * forward['eqmoe_of_peak']:.1f}% | {forward['ratio']:.2f}x | {100 * train['eqmoe_of_peak']:.1f}%"
    header = "| row | forward of peak | forward vs HF | train of peak | train vs HF | expert matmul torch/XLA |"
    assert header in " ".join(printed.split())
    assert summary in " ".join(printed.split())


def test_dtype_flag_reaches_both_benchmarks():
    import jax
    import tyro

    for module in (bench_model, bench_moe):
        assert tyro.cli(module.Args, args=["--dtype", "bfloat16"]).dtype == "bfloat16"
    assert bench_model.main(bench_model.Args(shape=("small",), dtype="bfloat16", breakdown=True)) == 2
    args = bench_moe.Args(dtype="bfloat16", embed=16, expert_dim=8, experts=4, top_k=2)
    layer = bench_moe._moe(args, "sorted", jax.random.key(0))
    assert {leaf.dtype.name for leaf in jax.tree.leaves(layer) if hasattr(leaf, "dtype")} == {"bfloat16"}


def test_gpu_script_parses_and_names_every_backend():
    script = Path(__file__).parents[1] / "experiments" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "set -euo pipefail" in text and "--dtype bfloat16" in text
    assert "--backends sorted ragged_dot dense capacity" in text
    from eqmoe.nn import dispatch

    assert {"sorted", "ragged_dot", "dense", "capacity"} <= set(dispatch.BACKENDS.names())
