"""The whole-model benchmark against transformers, on a tiny shape: rows, passes, breakdown and JSON."""

import json
import math

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
        assert row["config"] == {**TINY, "batch": 2, "seq": 16}
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


def test_shape_selection_and_overrides():
    rows = bench_model.selected_rows(bench_model.Args(shape=("wide-train", "small", "wide-forward"), seq_len=64))
    both = ("forward", "train")
    assert [(name, passes) for name, _, passes in rows] == [("wide", both), ("small", both)]
    assert all(shape.seq == 64 for _, shape, _ in rows)
    assert [name for name, _, _ in bench_model.selected_rows(bench_model.Args())] == ["small", "wide", "long"]
    assert bench_model.main(bench_model.Args(shape=("huge",))) == 2
