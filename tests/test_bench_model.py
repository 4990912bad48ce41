"""The whole-model benchmark against transformers, on a tiny shape: rows, passes, breakdown and JSON."""

import json
import math

import numpy as np
import pytest

from experiments import bench_model

pytest.importorskip("torch")
pytest.importorskip("transformers")

TINY = dict(layers=1, embed=32, heads=2, kv_heads=1, head_dim=16, experts=4, top_k=2, expert_dim=32, vocab=64)


def test_tiny_run_writes_every_row_pass_and_component(tmp_path):
    out = tmp_path / "bench.json"
    args = bench_model.Args(shape=("small",), **TINY, batch_size=2, seq_len=16, repeats=1, breakdown=True, json_out=out)
    assert bench_model.main(args) == 0
    results = json.loads(out.read_text())

    assert results["machine"]["cpu_count"] >= 1 and results["machine"]["jax_backend"]
    assert [(r["shape"], r["pass"]) for r in results["rows"]] == [("small", "forward"), ("small", "train")]
    for row in results["rows"]:
        assert row["config"] == {**TINY, "batch": 2, "seq": 16, "family": "qwen3_moe", "window": None}
        assert row["logit_max_abs_diff"] < 1e-3
        for field in ("eqmoe_ms", "hf_ms", "eqmoe_tokens_per_s", "hf_tokens_per_s", "eqmoe_compile_s"):
            assert row[field] > 0, field
        assert row["hf_first_call_s"] > 0 and math.isfinite(row["ratio"]) and row["ratio"] > 0
        assert row["ratio"] == pytest.approx(row["eqmoe_tokens_per_s"] / row["hf_tokens_per_s"])

    names = {entry["component"] for entry in results["breakdown"]}
    assert names == {"attention", "moe", "dense_swiglu_64", "rmsnorm", "embed_head_loss"}
    assert len(results["breakdown"]) == 2 * len(names)
    for entry in results["breakdown"]:
        assert entry["eqmoe_ms"] > 0 and entry["hf_ms"] > 0 and math.isfinite(entry["ratio"])
        assert entry["max_abs_diff"] < 1e-4, entry  # the same weights compute the same component
    assert results["sliding_over_full"] == []  # every layer attends fully


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
        assert row["config"] == {**shape, "batch": 1, "seq": 64, "family": "gpt_oss", "window": 16}
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
    assert bench_model.attention_layers(model.config) == {"attention_sliding": 0, "attention_full": 1}
    x, x_t = np.zeros((1, 8, TINY["embed"]), np.float32), torch.zeros(1, 8, TINY["embed"])
    masks = {
        name: bench_model.attention_component(name, index, shape, model, reference, x, x_t).their_const[1]
        for name, index in bench_model.attention_layers(model.config).items()
    }
    q, k = np.arange(8)[:, None], np.arange(8)[None, :]
    assert np.array_equal(masks["attention_sliding"][0, 0].numpy() == 0, (k <= q) & (k > q - 3))
    assert np.array_equal(masks["attention_full"][0, 0].numpy() == 0, k <= q)


def test_shape_selection_and_overrides():
    rows = bench_model.selected_rows(bench_model.Args(shape=("wide-train", "small", "wide-forward"), seq_len=64))
    both = ("forward", "train")
    assert [(name, passes) for name, _, passes in rows] == [("wide", both), ("small", both)]
    assert all(shape.seq == 64 for _, shape, _ in rows)
    # gpt-oss's 1 x 8,192 row (12 minutes here) runs when asked for
    assert [name for name, _, _ in bench_model.selected_rows(bench_model.Args())] == ["small", "wide", "long"]
    assert bench_model.main(bench_model.Args(shape=("huge",))) == 2

    [(name, shape, passes)] = bench_model.selected_rows(bench_model.Args(shape=("gpt-oss-train",), window=64))
    assert (name, passes, shape.family, shape.window) == ("gpt-oss", ("train",), "gpt_oss", 64)
    assert bench_model.main(bench_model.Args(shape=("gpt-oss-sideways",))) == 2
    assert bench_model.main(bench_model.Args(shape=("small",), window=64)) == 2  # no sliding layers to resize
