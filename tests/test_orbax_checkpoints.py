"""Orbax checkpoints: bit-identical round trips of a training-state pytree, metadata, pruning, atomicity, errors.

The state mixes what a training loop saves: an equinox Module with float32 and bfloat16 arrays (plus a
function leaf and a static field, which come back from the abstract tree), an int32 scalar step, a typed
PRNG key and an ``optax.adamw`` state after one update.
"""

import shutil
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from eqmoe.checkpoints.orbax import Checkpointer


class Tiny(eqx.Module):
    weight: jax.Array  # float32
    bias: jax.Array  # bfloat16
    activation: Callable = jax.nn.gelu  # a non-array leaf: not saved, taken from the abstract tree
    width: int = eqx.field(static=True, default=4)


def make_state(seed: int, rows: int = 8) -> dict:
    """A training state whose every array depends on ``seed``."""
    key, weight_key, bias_key = jax.random.split(jax.random.key(seed), 3)
    model = Tiny(jax.random.normal(weight_key, (rows, 4)), jax.random.normal(bias_key, (4,)).astype(jnp.bfloat16))
    optimizer = optax.adamw(1e-3)
    params = eqx.filter(model, eqx.is_array)
    opt_state = optimizer.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    model = eqx.apply_updates(model, updates)
    return {"model": model, "opt_state": opt_state, "step": jnp.int32(seed), "key": key}


ABSTRACT = eqx.filter_eval_shape(make_state, 0)


def assert_bit_identical(restored, original) -> None:
    assert jax.tree.structure(restored) == jax.tree.structure(original)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(original), strict=True):
        where = jax.tree_util.keystr(path)
        if not isinstance(want, jax.Array):
            assert got is want, where
            continue
        assert isinstance(got, jax.Array), where
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), where


def test_round_trip_is_bit_identical_with_metadata(tmp_path: Path):
    state = make_state(7)
    metadata = {"config": {"embed_dim": 4, "mlp_only_layers": [0], "rope": None}, "data_position": 1234, "lr": 3e-4}
    with Checkpointer(tmp_path / "run") as checkpointer:
        checkpointer.save(7, state, metadata)
        assert checkpointer.latest_step() == 7
    restored, restored_metadata = Checkpointer(tmp_path / "run").restore(None, ABSTRACT)
    assert_bit_identical(restored, state)
    assert restored_metadata == metadata
    assert jax.random.key_impl(restored["key"]) == jax.random.key_impl(state["key"])
    # The restored state trains on: the optimizer accepts its own restored state.
    params = eqx.filter(restored["model"], eqx.is_array)
    optax.adamw(1e-3).update(jax.tree.map(jnp.ones_like, params), restored["opt_state"], params)


def test_keep_last_prunes_old_steps(tmp_path: Path):
    checkpointer = Checkpointer(tmp_path, keep_last=2)
    for step in range(1, 5):
        checkpointer.save(step, make_state(step), {"step": step})
    assert checkpointer.all_steps() == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "4"]
    restored, metadata = checkpointer.restore(3, ABSTRACT)
    assert_bit_identical(restored, make_state(3))
    assert metadata == {"step": 3}
    checkpointer.close()


def test_half_written_step_is_ignored_and_replaced(tmp_path: Path):
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(1, make_state(1), {"step": 1})
    checkpointer.save(2, make_state(2), {"step": 2})
    # What an interrupted orbax 0.12 save leaves: the step and each item under a temporary name, with the
    # arrays written but no commit_success.txt anywhere (the final rename never happened).
    partial = tmp_path / "3.orbax-checkpoint-tmp"
    shutil.copytree(tmp_path / "2", partial)
    for item in ("arrays", "layout", "metadata"):
        (partial / item).rename(partial / f"{item}.orbax-checkpoint-tmp")
    for marker in partial.rglob("commit_success.txt"):
        marker.unlink()

    for reader in (checkpointer, Checkpointer(tmp_path)):
        assert reader.all_steps() == [1, 2]
        assert reader.latest_step() == 2
        assert reader.restore(None, ABSTRACT)[1] == {"step": 2}
    with pytest.raises(FileNotFoundError, match="step 3"):
        checkpointer.restore(3, ABSTRACT)

    checkpointer.save(3, make_state(3), {"step": 3})  # orbax removes the leftover before writing
    assert not partial.exists()
    assert_bit_identical(checkpointer.restore(None, ABSTRACT)[0], make_state(3))


def test_mismatched_abstract_tree_names_the_leaf(tmp_path: Path):
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(1, make_state(1), {})
    wrong_shape = eqx.filter_eval_shape(make_state, 0, rows=5)
    with pytest.raises(ValueError, match=r"\['model'\]\.weight: checkpoint has float32\[8, 4\], abstract_tree has "):
        checkpointer.restore(1, wrong_shape)
    no_key = {name: leaf for name, leaf in ABSTRACT.items() if name != "key"}
    with pytest.raises(ValueError, match=r"\['key'\]: in the checkpoint but not in abstract_tree"):
        checkpointer.restore(1, no_key)
    wrong_dtype = {**ABSTRACT, "step": jax.ShapeDtypeStruct((), jnp.float32)}
    with pytest.raises(ValueError, match=r"\['step'\]: checkpoint has int32\[\], abstract_tree has float32\[\]"):
        checkpointer.restore(1, wrong_dtype)


def test_missing_checkpoints_raise_file_not_found(tmp_path: Path):
    missing = tmp_path / "no-such-run"
    checkpointer = Checkpointer(missing)
    assert checkpointer.latest_step() is None and checkpointer.all_steps() == []
    with pytest.raises(FileNotFoundError, match="no-such-run: no such checkpoint directory"):
        checkpointer.restore(None, ABSTRACT)
    assert not missing.exists()  # reading never creates the directory
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="empty: no finished checkpoint"):
        Checkpointer(empty).restore(None, ABSTRACT)


def test_bad_saves_are_refused(tmp_path: Path):
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(5, make_state(5), {})
    with pytest.raises(ValueError, match="cannot save step 5; steps must increase"):
        checkpointer.save(5, make_state(5), {})
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        checkpointer.save(6, make_state(6), {"array": np.zeros(2)})
    assert checkpointer.all_steps() == [5]
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(tmp_path, keep_last=0)
