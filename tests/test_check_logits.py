"""The logit checker and the streaming, sharded Hugging Face export."""

import json
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from eqmoe.analysis.logits import compare_logits
from eqmoe.checkpoints import hf
from eqmoe.losses import objective
from eqmoe.train.optimizer import OptimizerConfig, make_optimizer
from experiments import check_logits
from tests.conftest import load_reference, save_tiny_hf

torch = pytest.importorskip("torch")


def test_compare_logits_against_hand_computed_values():
    reference = np.log(np.array([[0.5, 0.25, 0.25], [0.7, 0.2, 0.1]]))
    candidate = np.log(np.array([[0.25, 0.5, 0.25], [0.7, 0.1, 0.2]]))
    result = compare_logits(reference, candidate, top_k=2)
    kl = [0.5 * np.log(2) + 0.25 * np.log(0.5), 0.2 * np.log(2) + 0.1 * np.log(0.5)]
    assert result.kl_max == pytest.approx(max(kl)) and result.kl_mean == pytest.approx(np.mean(kl))
    assert (result.top_k_overlap, result.jaccard, result.rank_agreement) == (1, 1 / 3, 0.5)


def test_check_logits_passes_on_a_converted_model_and_fails_on_a_perturbed_expert(tmp_path, capsys):
    save_tiny_hf(tmp_path / "hf")
    assert check_logits.main(check_logits.Args(hf=tmp_path / "hf")) == 0
    assert "PASS" in capsys.readouterr().out
    shutil.copytree(tmp_path / "hf", tmp_path / "perturbed")
    tensors = load_file(tmp_path / "perturbed" / "model.safetensors")
    key = "model.layers.1.mlp.experts.3.down_proj.weight"
    tensors[key] = tensors[key] + 0.5
    save_file(tensors, tmp_path / "perturbed" / "model.safetensors", metadata={"format": "pt"})
    assert check_logits.main(check_logits.Args(hf=tmp_path / "hf", candidate=tmp_path / "perturbed")) == 1
    assert "FAIL" in capsys.readouterr().out
    assert check_logits.main(check_logits.Args(hf=tmp_path / "nothing")) == 2
    assert "no config.json" in capsys.readouterr().err


def test_one_training_step_then_sharded_export_loads_in_transformers(tmp_path):
    save_tiny_hf(tmp_path / "hf", mlp_only_layers=[0])
    model = hf.load(tmp_path / "hf")
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, model.config.vocab_size)
    optimizer, _ = make_optimizer(
        OptimizerConfig(learning_rate=1e-2, warmup_steps=0),
        eqx.filter(model, eqx.is_array),
        embed_dim=model.config.embed_dim,
    )
    loss = lambda m: objective(m(tokens), tokens, jnp.ones(tokens.shape, bool), m.config)[0]  # noqa: E731
    grads = eqx.filter_jit(eqx.filter_grad(loss))(model)
    updates, _ = optimizer.update(
        grads, optimizer.init(eqx.filter(model, eqx.is_array)), eqx.filter(model, eqx.is_array)
    )
    trained = eqx.apply_updates(model, updates)
    hf.save(trained, tmp_path / "out", max_shard_size="40KB")
    index = json.loads((tmp_path / "out" / hf.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    with torch.no_grad():
        expected = load_reference(tmp_path / "out")(torch.tensor(np.asarray(tokens))).logits.numpy()
    np.testing.assert_allclose(eqx.filter_jit(trained)(tokens).logits, expected, atol=1e-4, rtol=0)
    reloaded = hf.load(tmp_path / "out")
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(reloaded), strict=True):
        np.testing.assert_array_equal(a, b)


def test_bfloat16_export_and_bad_shard_size(tmp_path):
    save_tiny_hf(tmp_path / "hf")
    model = hf.load(tmp_path / "hf")
    hf.save(model, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert hf.load(tmp_path / "bf16", dtype="bfloat16").embed.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="max_shard_size"):
        hf.save(model, tmp_path / "bad", max_shard_size="lots")
    assert not (tmp_path / "bad").exists()


def test_a_vocabulary_padded_beyond_the_tokenizer_still_checks(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "the", "capital", "of", "france", "is", "def", "fibonacci(n):", "models", "route"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    save_tiny_hf(tmp_path / "hf")  # vocabulary 97, tokenizer 10
    tokenizer.save(str(tmp_path / "hf" / "tokenizer.json"))
    assert check_logits.main(check_logits.Args(hf=tmp_path / "hf")) == 0
    assert "PASS" in capsys.readouterr().out
