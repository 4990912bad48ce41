"""Loading a Hugging Face folder: parameters in the dtype its files hold unless told otherwise, and the same model
whether each parameter is put on one device or placed slice by slice (the mesh path, here on a one-device mesh;
``tests/mesh_cases.py`` splits it over eight)."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from eqmoe import parallel
from eqmoe.checkpoints import hf
from tests.conftest import save_tiny_hf

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    """A transformers-saved tiny model whose files are bfloat16, as Hub checkpoints of large models are."""
    folder = tmp_path_factory.mktemp("bf16")
    save_tiny_hf(folder, mlp_only_layers=[1]).to(torch.bfloat16).save_pretrained(folder)
    return folder


def _leaves(model) -> list:
    return [leaf for leaf in jax.tree.leaves(model) if isinstance(leaf, jax.Array)]


def test_default_dtype_is_the_one_config_json_declares(bf16_folder):
    assert hf.stored_dtype(bf16_folder) == "bfloat16"
    model = hf.load(bf16_folder)
    assert (model.config.param_dtype, model.config.dtype) == ("bfloat16", "bfloat16")
    assert {leaf.dtype for leaf in _leaves(model)} == {jnp.dtype(ml_dtypes.bfloat16)}

    wide = hf.load(bf16_folder, dtype="float32", compute_dtype="bfloat16")  # an explicit dtype still casts
    assert (wide.config.param_dtype, wide.config.dtype) == ("float32", "bfloat16")
    for narrow, exact in zip(_leaves(model), _leaves(wide), strict=True):
        assert exact.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(narrow), np.asarray(exact).astype(ml_dtypes.bfloat16))


def test_undeclared_dtype_loads_as_float32(bf16_folder, tmp_path):
    (tmp_path / hf.SINGLE_FILE).symlink_to(bf16_folder / hf.SINGLE_FILE)
    declared = json.loads((bf16_folder / "config.json").read_text())
    undeclared = {k: v for k, v in declared.items() if k not in ("dtype", "torch_dtype")}
    (tmp_path / "config.json").write_text(json.dumps(undeclared))
    assert hf.load(tmp_path).config.param_dtype == "float32"


def test_placing_slice_by_slice_gives_the_same_model(bf16_folder):
    one = parallel.make_parallelism("data=1", devices=jax.devices()[:1])
    placed, plain = hf.load(bf16_folder, parallelism=one), hf.load(bf16_folder)
    for a, b in zip(_leaves(placed), _leaves(plain), strict=True):
        assert a.sharding.mesh.shape == one.mesh.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
