"""The step profiler: operations' own times from nested trace events, matmul FLOPs and passes from the optimized HLO."""

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqmoe
from eqmoe.analysis import xla_profile


def _event(name, ts, dur, tid=1):
    return {"ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": tid, "name": name, "args": {"hlo_op": name}}


def test_own_time_is_a_traced_time_less_what_runs_nested_in_it_on_its_thread():
    events = [
        _event("while.1", 0, 100),
        _event("dot.1", 10, 30),
        _event("add.1", 50, 20),
        _event("dot.1", 110, 30),  # after the loop: counted again
        _event("copy.1", 20, 500, tid=2),  # another thread: nothing nests in it
        {"ph": "X", "ts": 0, "dur": 1000, "pid": 1, "tid": 1, "name": "ThunkExecutor::Execute"},  # not an op
    ]
    times = xla_profile.own_times(events, {"while.1", "dot.1", "add.1", "copy.1"})
    assert times == {
        "while.1": (1, pytest.approx(50e-6)),
        "dot.1": (2, pytest.approx(60e-6)),
        "add.1": (1, pytest.approx(20e-6)),
        "copy.1": (1, pytest.approx(500e-6)),
    }


def test_a_traced_gradient_counts_each_matmul_once_per_run_with_its_flops_and_pass():
    n, layers = 128, 3

    def loss(a, w):
        def layer(carry, weight):
            return jnp.tanh(carry @ weight), None

        return jax.lax.scan(layer, a, w)[0].sum()

    a, w = jnp.ones((n, n)) / n, jnp.ones((layers, n, n)) / n
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(a, w).compile()
    jax.block_until_ready(compiled(a, w))
    result = xla_profile.profile(lambda: compiled(a, w), compiled.as_text(), calls=2, wall_seconds=1.0)

    one_matmul = 2 * n**3
    # forward: one product per layer; backward: two (the input's gradient and the weight's)
    assert result.by_kind["matmul"].flops == pytest.approx(3 * layers * one_matmul)
    assert result.by_pass["forward"].flops == pytest.approx(layers * one_matmul)
    assert result.by_pass["backward"].flops == pytest.approx(2 * layers * one_matmul)
    assert result.by_kind["matmul"].count == pytest.approx(3 * layers)
    assert result.traced_seconds > 0 and result.matmul_rate() > 0
    assert set(result.by_kind) <= set(xla_profile.KINDS)
    assert any(key.startswith("test_xla_profile.py:") and "[matmul]" in key for key in result.by_where)


def test_a_frame_is_named_by_the_package_it_lies_in_not_by_a_folder_called_eqmoe():
    package = Path(eqmoe.__file__).parent
    assert xla_profile._short(str(package / "nn" / "flash.py")) == "eqmoe/nn/flash.py"
    assert xla_profile._short(str(Path(eqx.__file__).parent / "_module.py")) == "equinox/_module.py"
    # a checkout named eqmoe: its tests are not the package
    assert xla_profile._short("/home/someone/eqmoe/tests/test_xla_profile.py") == "test_xla_profile.py"
    assert xla_profile._short(f"/elsewhere/eqmoe/{package.name}/model.py") == "model.py"


def test_operations_read_dots_inside_fusions_and_loops_from_hlo_text():
    def f(x, y):
        return jax.lax.fori_loop(0, 4, lambda i, acc: acc + jnp.exp(x @ y), jnp.zeros((32, 48)))

    text = jax.jit(f).lower(jnp.ones((32, 64)), jnp.ones((64, 48))).compile().as_text()
    ops = xla_profile.operations(text)
    matmuls = [op for op in ops.values() if op.kind == "matmul"]
    assert sum(op.flops for op in matmuls) == 2 * 32 * 48 * 64  # one product in the body (run 4 times)
    assert any(op.kind == "loop control" for op in ops.values())
    assert all(op.pass_ == "forward" for op in ops.values())


def test_a_loop_slicing_its_weights_counts_the_slices_as_data_movement():
    def f(x, w):
        return jax.lax.scan(lambda c, layer: (jnp.tanh(c @ layer), None), x, w)[0]

    text = jax.jit(f).lower(jnp.ones((16, 64)), jnp.ones((3, 64, 64))).compile().as_text()
    kinds = {op.kind for op in xla_profile.operations(text).values() if "dynamic-slice" in op.name}
    assert kinds == {"data movement"}, kinds


SLICE_WITH_INDEX_ARITHMETIC = """HloModule m

%fused_slice (p0: f32[3,64,64], p1: s32[]) -> f32[1,64,64] {
  %p0 = f32[3,64,64]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %negative = pred[] compare(%p1, %zero), direction=LT
  %three = s32[] constant(3)
  %wrapped = s32[] add(%p1, %three)
  %index = s32[] select(%negative, %wrapped, %p1)
  ROOT %slice = f32[1,64,64]{2,1,0} dynamic-slice(%p0, %index, %zero, %zero), dynamic_slice_sizes={1,64,64}
}

ENTRY %main (a: f32[3,64,64], i: s32[]) -> f32[1,64,64] {
  %a = f32[3,64,64]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  ROOT %slice_fusion = f32[1,64,64]{2,1,0} fusion(%a, %i), kind=kLoop, calls=%fused_slice
}
"""


def test_a_slice_whose_start_index_is_computed_is_still_data_movement():
    assert xla_profile.operations(SLICE_WITH_INDEX_ARITHMETIC)["slice_fusion"].kind == "data movement"


def test_each_operation_carries_the_shape_of_its_result():
    ops = xla_profile.operations(SLICE_WITH_INDEX_ARITHMETIC)
    assert ops["slice_fusion"].shape == (1, 64, 64)
    assert ops["a"].shape == (3, 64, 64) and ops["i"].shape == ()


def test_separate_layers_compute_what_the_stacked_ones_do():
    """profile_step --layers separate times the same model: the logits and routing of the stacked scan."""
    from eqmoe import Transformer, presets
    from experiments.profile_step import SeparateLayers

    config = presets.get("qwen3-moe-micro")  # four MoE layers: one unit scanned four times
    model = Transformer(config, key=jax.random.key(0))
    separate = eqx.tree_at(lambda m: m.segments, model, tuple(SeparateLayers(s) for s in model.segments))
    size = lambda tree: sum(leaf.size for leaf in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))  # noqa: E731
    assert size(separate) == size(model) and [len(s.units) for s in separate.segments] == [4]
    tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, config.vocab_size)
    stacked_out, separate_out = eqx.filter_jit(model)(tokens), eqx.filter_jit(separate)(tokens)
    np.testing.assert_allclose(separate_out.logits, stacked_out.logits, atol=1e-6, rtol=0)
    np.testing.assert_allclose(separate_out.aux.expert_counts, stacked_out.aux.expert_counts)
