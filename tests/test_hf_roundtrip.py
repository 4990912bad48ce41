"""Hugging Face export: eqmoe -> safetensors folder -> transformers, and HF -> eqmoe -> HF unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from eqmoe import Transformer, presets
from eqmoe.checkpoints import hf
from tests.conftest import load_reference, save_tiny_hf

torch = pytest.importorskip("torch")


def test_saved_model_loads_in_transformers_with_equal_logits(tmp_path):
    config = presets.get("qwen3-moe-tiny").replace(layers=tuple(["dense", "moe", "moe"]))
    model = Transformer(config, key=jax.random.key(0))
    hf.save(model, tmp_path / "out")
    reference = load_reference(tmp_path / "out")
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 12))
    with torch.no_grad():
        expected = reference(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(model(jnp.asarray(ids)).logits, expected, atol=1e-4, rtol=0)


def test_hf_to_eqmoe_to_hf_is_bit_exact(tmp_path):
    save_tiny_hf(tmp_path / "hf", mlp_only_layers=[1], tie_word_embeddings=True)
    hf.save(hf.load(tmp_path / "hf"), tmp_path / "back")
    original, back = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "back" / "model.safetensors"),
    )
    assert set(original) == set(back)
    for key, value in original.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)


def test_save_refuses_an_existing_folder_and_leaves_no_partial_output(tmp_path):
    model = Transformer(presets.get("qwen3-moe-tiny").replace(layers=tuple(["moe"])), key=jax.random.key(1))
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        hf.save(model, tmp_path / "out")
    unexpressible = model.config.replace(norm=model.config.norm.__class__(ffn_placement="hybrid"))
    with pytest.raises(ValueError, match="ffn_placement"):
        hf.save(Transformer(unexpressible, key=jax.random.key(1)), tmp_path / "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
