"""``auto`` by measurement (eqmoe.autotune): the fastest eligible backend wins, the choice is cached, logged, forced
names are left alone, and a run records its choice and takes it again on resume."""

import dataclasses
import json
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.experimental import io_callback

from eqmoe import autotune, presets
from eqmoe.autotune import timing, workloads
from eqmoe.checkpoints.orbax import Checkpointer
from eqmoe.nn import dispatch
from eqmoe.registries import ATTENTION_BACKENDS, DISPATCH_BACKENDS
from experiments import pretrain

SLEEP = 0.25  # far above a step of the micro model, also on a loaded machine (0.05 lost once in CI-like load)


def _slow_sorted(x, routing, experts, config):
    """The sorted backend plus a host round trip that sleeps: the same numbers, deliberately slower."""

    def sleep(value):
        time.sleep(SLEEP)
        return value.astype("float32")

    # io_callback: a side effect, so XLA keeps it although nothing needs its value
    delay = io_callback(sleep, jax.ShapeDtypeStruct((), jnp.float32), jax.lax.stop_gradient(x[0, 0]))
    return dispatch.sorted_blocks(x, routing, experts, config) + 0.0 * delay.astype(x.dtype)


def _config(**moe):
    micro = presets.get("qwen3-moe-micro")
    attention = dataclasses.replace(micro.attention, backend="blockwise")  # only the dispatch is auto here
    return dataclasses.replace(micro, attention=attention, moe=dataclasses.replace(micro.moe, **moe))


@pytest.fixture
def only_slow_and_fast(monkeypatch):
    sorted_backend = DISPATCH_BACKENDS.get("sorted")
    backends = {
        "deliberately_slow": dispatch.Backend(_slow_sorted, sorted_backend.estimate),
        "fast": sorted_backend,
    }
    monkeypatch.setattr(DISPATCH_BACKENDS, "_items", backends)
    monkeypatch.setenv(autotune.ENV, "measure")


def test_auto_times_the_candidates_picks_the_fast_one_caches_it_and_a_forced_name_wins(
    only_slow_and_fast, tmp_path, monkeypatch
):
    cache, lines = tmp_path / "auto.json", []
    resolved = autotune.resolve(_config(), rows=2, seq=32, cache=cache, report=lines.append)
    assert resolved.choices == {"moe.dispatch": "fast"} and resolved.config.moe.dispatch == "fast"
    (measured,) = resolved.measurements
    assert measured.how == "measured" and measured.seconds["deliberately_slow"] >= SLEEP > measured.seconds["fast"]
    assert lines == [measured.line()]
    assert lines[0].startswith("auto moe.dispatch -> 'fast' (measured on 64 tokens x 64, 8 experts top-2")
    assert "forward+backward: fast " in lines[0] and "deliberately_slow" in lines[0]

    def no_timing(*args, **kwargs):
        raise AssertionError("a cached choice is not timed again")

    monkeypatch.setattr(timing, "time_calls", no_timing)
    again = autotune.resolve(_config(), rows=2, seq=32, cache=cache, report=lines.append)
    assert again.choices == {"moe.dispatch": "fast"} and again.measurements[0].how == "cached"
    assert "(cached on 64 tokens" in lines[1]
    # Another shape is another measurement; a name given by the user is never measured or replaced.
    with pytest.raises(AssertionError, match="not timed again"):
        autotune.resolve(_config(), rows=4, seq=32, cache=cache, report=lines.append)
    forced = autotune.resolve(_config(dispatch="deliberately_slow"), rows=4, seq=32, cache=cache)
    assert forced.choices == {} and forced.config.moe.dispatch == "deliberately_slow"
    ((key, entry),) = json.loads(cache.read_text()).items()  # the one measured shape
    assert (
        entry["choice"] == "fast" and json.loads(key)["device"].startswith("cpu:") and json.loads(key)["tokens"] == 64
    )


def test_rule_mode_and_meshes_time_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(timing, "time_calls", lambda *a, **k: pytest.fail("timed"))
    monkeypatch.setenv(autotune.ENV, "rule")
    config = presets.get("qwen3-moe-micro")
    ruled = autotune.resolve(config, rows=2, seq=32, cache=tmp_path / "a.json", report=lambda line: None)
    assert ruled.choices == {} and ruled.config == config  # the rules apply where the layers run
    monkeypatch.setenv(autotune.ENV, "measure")
    meshed = autotune.resolve(config, rows=2, seq=32, devices=8, cache=tmp_path / "a.json", report=lambda line: None)
    assert meshed.choices == ruled.choices
    monkeypatch.setenv(autotune.ENV, "rule")  # a recorded choice wins over the rule too
    capacity = dataclasses.replace(config.moe.router, capacity_factor=1.25)
    moe = dataclasses.replace(config.moe, router=capacity)
    recorded = autotune.resolve(
        dataclasses.replace(config, moe=moe), 2, 32, recorded={"moe.dispatch": "dense"}, report=lambda line: None
    )
    assert recorded.choices == {"moe.dispatch": "dense"} and recorded.measurements[0].how == "recorded by the run"


def test_eligibility_keeps_memory_in_the_order_of_the_best():
    config = presets.get("qwen3-moe-micro")  # block_size 256
    one_tile = workloads.AttentionWorkload(config, rows=2, seq=256, training=True)
    longer = workloads.AttentionWorkload(config, rows=2, seq=257, training=True)
    names = tuple(ATTENTION_BACKENDS.names())
    assert one_tile.eligible("dense", names) is None and one_tile.eligible("blockwise", names) is None
    assert "quadratic memory" in longer.eligible("dense", names)
    assert "plain causal" in one_tile.eligible("cudnn", names)
    many = dataclasses.replace(config.moe, router=dataclasses.replace(config.moe.router, num_experts=64))
    workload = workloads.DispatchWorkload(dataclasses.replace(config, moe=many), tokens=4096, training=True)
    names = tuple(DISPATCH_BACKENDS.names())
    assert "activations of the leanest" in workload.eligible("dense", names)  # every expert on every token
    assert workload.eligible("sorted", names) is None
    assert workload.eligible("capacity", names) == "needs a capacity factor"


def test_a_row_in_one_blockwise_tile_is_also_timed_in_two_and_the_winner_sets_the_tile(tmp_path, monkeypatch):
    config = presets.get("qwen3-moe-micro")  # block_size 256
    names = workloads.AttentionWorkload(config, rows=2, seq=128, training=True).candidates()
    assert names[names.index("blockwise") + 1] == "blockwise[64]"
    for seq in (130, 255):  # half a row, rounded up to a multiple of 8
        assert f"blockwise[{-(-seq // 16) * 8}]" in workloads.AttentionWorkload(config, 2, seq, True).candidates()
    for seq in (96, 257):  # half a row below the smallest tile timed; a row already in several tiles
        assert not any("[" in n for n in workloads.AttentionWorkload(config, 2, seq, True).candidates())
    monkeypatch.setenv(autotune.ENV, "measure")
    seconds = {"blockwise[64]": 1e-3, "blockwise": 2e-3, "dense": 3e-3}
    monkeypatch.setattr(timing, "time_calls", lambda function, arguments, best: seconds[function[0]])
    monkeypatch.setattr(workloads.AttentionWorkload, "program", lambda self, label: ((label,), ()))  # nothing built
    micro = dataclasses.replace(config, moe=dataclasses.replace(config.moe, dispatch="sorted"))
    resolved = autotune.resolve(micro, rows=2, seq=128, cache=tmp_path / "a.json", report=lambda line: None)
    assert resolved.choices == {"attention.backend": "blockwise", "attention.block_size": "64"}
    assert resolved.config.attention.backend == "blockwise" and resolved.config.attention.block_size == 64


def _pretrain(out_dir, steps, resume=False):
    return pretrain.Args(
        data=pretrain.DataOptions(seq_len=32, batch_size=2, chars_per_domain=3_000, eval_chars_per_domain=800),
        run=pretrain.RunOptions(steps=steps, out_dir=out_dir, checkpoint_every=1, eval_every=100, resume=resume),
    )


def test_a_run_records_its_choice_and_a_resume_takes_it_again(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(autotune.ENV, "measure")
    # Timing is the first test's business: here every candidate costs the same, so the first registered one wins,
    # and none is built.
    monkeypatch.setattr(workloads.DispatchWorkload, "program", lambda self, name: (None, ()))
    monkeypatch.setattr(workloads.AttentionWorkload, "program", lambda self, name: (None, ()))
    monkeypatch.setattr(timing, "time_calls", lambda function, arguments, best: 1e-3)
    out = tmp_path / "run"
    pretrain.run(_pretrain(out, 1))
    err = capsys.readouterr().err
    assert "auto moe.dispatch -> 'dense' (measured" in err and "auto attention.backend -> 'blockwise' (measured" in err
    with Checkpointer(out / "checkpoints", keep_last=None) as checkpointer:
        stored = checkpointer.metadata()
    assert stored["backends"] == {"moe.dispatch": "dense", "attention.backend": "blockwise"}
    assert stored["config"]["moe"]["dispatch"] == "auto"  # the config as given; the choice beside it

    (tmp_path / "cache").mkdir()
    monkeypatch.setenv("EQMOE_CACHE", str(tmp_path / "cache"))  # a fresh cache: only the record can answer
    monkeypatch.setattr(timing, "time_calls", lambda *a, **k: pytest.fail("a resumed run is not timed again"))
    pretrain.run(_pretrain(out, 2, resume=True))
    err = capsys.readouterr().err
    assert "auto moe.dispatch -> 'dense' (recorded by the run)" in err
    assert "resumed from step 1" in err


def test_a_candidate_that_runs_out_of_memory_is_skipped_and_named(only_slow_and_fast, tmp_path, monkeypatch):
    def exhausted(*arguments):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 34468940112 bytes.")

    real = workloads.DispatchWorkload.program
    monkeypatch.setattr(
        workloads.DispatchWorkload,
        "program",
        lambda self, name: (exhausted, ()) if name == "deliberately_slow" else real(self, name),
    )
    resolved = autotune.resolve(_config(), rows=1, seq=32, cache=tmp_path / "a.json", report=lambda line: None)
    assert resolved.choices == {"moe.dispatch": "fast"}
    assert resolved.measurements[0].skipped == {"deliberately_slow": "out of memory"}


@pytest.mark.parametrize(("scan_layers", "remat"), [(True, "none"), (False, "none"), (True, "block")])
def test_candidates_run_as_the_models_layers_run(scan_layers, remat):
    """What a backend keeps for the backward pass crosses the layer scan in the model (dense attention's
    probabilities made the sft quickstart's step 1.15x slower though one call alone was faster), so each candidate
    runs as the model's layers: scanned or unrolled, recomputed or not, and is cached apart by how it ran."""
    config = presets.get("qwen3-moe-micro").replace(scan_layers=scan_layers, remat=remat)
    for workload in (
        workloads.AttentionWorkload(config, rows=2, seq=32, training=False),  # forward: the remat is still there
        workloads.DispatchWorkload(config, tokens=64, training=False),
    ):
        function, arguments = workload.program("dense")
        jaxpr = str(eqx.filter_make_jaxpr(function)(*arguments)[0])
        assert (" scan[" in jaxpr) == scan_layers and ("remat" in jaxpr) == (remat == "block"), workload.field
        assert all(leaf.shape[0] == workloads.LAYERS for leaf in jax.tree.leaves(arguments[0]))
        assert f"{workloads.LAYERS} {'scanned' if scan_layers else 'unrolled'} layers" in workload.description
        assert (workload.key["layers"], workload.key["scan_layers"], workload.key["remat"]) == (2, scan_layers, remat)
