"""Sparse upcycling (experiments.upcycle) of tiny dense models written by transformers: without re-initialisation the
MoE computes the dense model's logits (in transformers and in eqmoe), loads in transformers' MoE class with eqmoe's
logits, and fine-tunes with sft; Drop-Upcycling re-initialises each expert's own seeded units from the matrix's
statistics; requests that cannot be met are one line, exit code 2 and nothing written."""

import dataclasses
import json
import shutil

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from eqmoe.checkpoints import hf
from experiments import convert, sft, upcycle
from tests import hf_families as shared
from tests.test_dense_families import LLAMA, QWEN3

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# dense family, --shared-experts -> the MoE class transformers loads the result with
CASES = {
    "qwen3": (QWEN3, 0, transformers.Qwen3MoeForCausalLM),
    "llama": (LLAMA, 0, transformers.MixtralForCausalLM),
    "llama-shared-expert": (LLAMA, 1, transformers.Qwen2MoeForCausalLM),
}


def _upcycle(dense, out, **options) -> int:
    return upcycle.main(upcycle.Args(hf=dense, out=out, **{"experts": 4, "top_k": 2, **options}))


def _ours(folder, ids: np.ndarray) -> np.ndarray:
    model = hf.load(folder)
    return np.asarray(eqx.filter_jit(lambda m, t: m(t).logits)(model, jnp.asarray(ids)))


def _theirs(model_class, folder, ids: np.ndarray) -> np.ndarray:
    model = model_class.from_pretrained(folder, attn_implementation="eager", experts_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.numpy()


@pytest.mark.parametrize("case", list(CASES))
def test_upcycled_logits_equal_the_dense_models(case, tmp_path):
    family, shared_experts, moe_class = CASES[case]
    family.save_tiny(tmp_path / "dense", seed=5, tie_word_embeddings=case == "llama")
    assert _upcycle(tmp_path / "dense", tmp_path / "moe", shared_experts=shared_experts, seed=3) == 0
    written = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert written["architectures"] == [moe_class.__name__] and written["num_experts_per_tok"] == 2

    ids = np.random.default_rng(0).integers(0, family.tiny["vocab_size"], (2, 64))
    dense_logits = _theirs(family.model_class, tmp_path / "dense", ids)
    moe_logits = _theirs(moe_class, tmp_path / "moe", ids)
    ours = _ours(tmp_path / "moe", ids)
    assert np.abs(dense_logits).max() > 1.0
    np.testing.assert_allclose(moe_logits, dense_logits, atol=1e-5, rtol=0)  # transformers: MoE == dense
    np.testing.assert_allclose(ours, _ours(tmp_path / "dense", ids), atol=1e-5, rtol=0)  # eqmoe: MoE == dense
    np.testing.assert_allclose(ours, moe_logits, atol=1e-4, rtol=0)  # eqmoe's MoE == transformers'

    dense, moe = load_file(tmp_path / "dense" / "model.safetensors"), load_file(tmp_path / "moe" / "model.safetensors")
    experts = [key for key in moe if ".experts." in key]
    assert len(experts) == 2 * 4 * 3
    for key in experts:  # the dense FFN's matrices bit for bit, the down projections halved beside a shared expert
        halved = shared_experts and "down_proj" in key
        np.testing.assert_array_equal(moe[key], dense[_dense_source(key)] * (0.5 if halved else 1), err_msg=key)
    router_names = (".mlp.gate.weight", ".block_sparse_moe.gate.weight")
    routers = [value for key, value in moe.items() if key.endswith(router_names)]
    assert len(routers) == 2 and all(0.01 < router.std() < 0.03 for router in routers)  # N(0, 0.02^2): random
    if shared_experts:  # the dense FFN itself, behind a gate at sigmoid(0) = 1/2
        for layer in range(2):
            prefix = f"model.layers.{layer}.mlp."
            assert not moe[prefix + "shared_expert_gate.weight"].any()
            for matrix in ("gate_proj", "up_proj", "down_proj"):
                key = f"{matrix}.weight"
                np.testing.assert_array_equal(moe[prefix + "shared_expert." + key], dense[prefix + key])


_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _dense_source(expert_key: str) -> str:
    """The dense FFN matrix an expert's matrix was copied from (Qwen-style or Mixtral's names)."""
    layer = expert_key.split(".")[2]
    matrix = expert_key.split(".experts.")[1].split(".")[1]
    return f"model.layers.{layer}.mlp.{_MIXTRAL_NAMES.get(matrix, matrix)}.weight"


def test_drop_upcycling_redraws_each_experts_own_seeded_units(tmp_path):
    """Drop-Upcycling with ratio 0.5: every expert keeps half of the dense FFN's intermediate units and redraws the
    other half (rows of gate_proj and up_proj, the same columns of down_proj) from N(mean, std^2) of each matrix;
    the sets differ between experts, and the same seed writes the same files."""
    QWEN3.save_tiny(tmp_path / "dense", seed=1)
    assert _upcycle(tmp_path / "dense", tmp_path / "a", drop_ratio=0.5, seed=7) == 0
    assert _upcycle(tmp_path / "dense", tmp_path / "b", drop_ratio=0.5, seed=7) == 0
    assert _upcycle(tmp_path / "dense", tmp_path / "c", drop_ratio=0.5, seed=8) == 0
    dense = load_file(tmp_path / "dense" / "model.safetensors")
    a, b, c = (load_file(tmp_path / run / "model.safetensors") for run in "abc")
    assert all(np.array_equal(a[key], b[key]) for key in a)
    assert not np.array_equal(
        a["model.layers.0.mlp.experts.0.up_proj.weight"], c["model.layers.0.mlp.experts.0.up_proj.weight"]
    )
    width = QWEN3.tiny["intermediate_size"]
    for layer in range(QWEN3.tiny["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp."
        redrawn_sets = []
        for expert in range(4):
            kept = {}
            for matrix, axis in (("gate_proj", 1), ("up_proj", 1), ("down_proj", 0)):
                original, copy = dense[prefix + f"{matrix}.weight"], a[prefix + f"experts.{expert}.{matrix}.weight"]
                kept[matrix] = np.all(original == copy, axis=axis)
                redrawn = copy[~kept[matrix]] if axis == 1 else copy[:, ~kept[matrix]]
                assert abs(redrawn.mean() - original.mean()) < 0.5 * original.std()
                assert 0.7 < redrawn.std() / original.std() < 1.3, (matrix, redrawn.std(), original.std())
            assert np.array_equal(kept["gate_proj"], kept["up_proj"]) and np.array_equal(
                kept["gate_proj"], kept["down_proj"]
            )
            assert (~kept["gate_proj"]).sum() == width // 2
            redrawn_sets.append(tuple(np.flatnonzero(~kept["gate_proj"])))
        assert len(set(redrawn_sets)) == 4
    ids = np.random.default_rng(0).integers(0, QWEN3.tiny["vocab_size"], (1, 16))
    moe_logits = _theirs(transformers.Qwen3MoeForCausalLM, tmp_path / "a", ids)
    assert np.abs(moe_logits - _theirs(QWEN3.model_class, tmp_path / "dense", ids)).max() > 1e-3


def test_sft_fine_tunes_the_upcycled_model_and_convert_exports_it(tmp_path):
    """The upcycled folder is an ordinary Qwen3-MoE one: sft starts from it and its loss falls, and the fine-tuned
    checkpoint exports to a folder transformers loads with eqmoe's logits."""
    QWEN3.save_tiny(tmp_path / "dense", vocab_size=300, num_hidden_layers=2, eos_token_id=1)
    assert _upcycle(tmp_path / "dense", tmp_path / "moe") == 0
    run = sft.RunOptions(
        steps=30, out_dir=tmp_path / "run", checkpoint_every=30, eval_every=1000, log_every=5, samples=0
    )
    args = sft.Args(
        model=sft.ModelOptions(init_from_hf=tmp_path / "moe"),
        data=sft.DataOptions(seq_len=64, batch_size=4, train_examples=120, eval_examples=4),
        optim=dataclasses.replace(sft.Args().optim, learning_rate=3e-3, warmup_steps=3),
        run=run,
    )
    assert sft.main(args) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["cross_entropy"] for r in records if "cross_entropy" in r]
    assert np.mean(losses[-2:]) < losses[0] - 0.5, losses  # ~4.9 to ~3.7 over 30 steps (logged every 5)

    assert convert.main(convert.Args(checkpoint=tmp_path / "run" / "checkpoints", to_hf=tmp_path / "tuned")) == 0
    ids = np.random.default_rng(0).integers(0, 300, (2, 32))
    ours = _ours(tmp_path / "tuned", ids)
    np.testing.assert_allclose(_theirs(transformers.Qwen3MoeForCausalLM, tmp_path / "tuned", ids), ours, atol=1e-4)
    assert np.abs(ours - _ours(tmp_path / "moe", ids)).max() > 1e-2  # training changed it


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A dense Qwen3 folder, a Qwen3 one with attention biases (Qwen3-MoE has none), one that says its weights are
    block-FP8, one without a tensor, a Llama folder, a MoE folder and an unsupported model type."""
    root = tmp_path_factory.mktemp("upcycle-inputs")
    QWEN3.save_tiny(root / "qwen3")
    QWEN3.save_tiny(root / "qwen3-bias", attention_bias=True)
    LLAMA.save_tiny(root / "llama")
    assert _upcycle(root / "qwen3", root / "qwen3-moe") == 0
    shared.write_config(root / "gpt2", {"model_type": "gpt2", "n_embd": 32})
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    shutil.copytree(root / "qwen3", root / "qwen3-fp8")
    config = json.loads((root / "qwen3" / "config.json").read_text())
    shared.write_config(root / "qwen3-fp8", {**config, "quantization_config": fp8})
    shutil.copytree(root / "qwen3", root / "qwen3-incomplete")
    tensors = load_file(root / "qwen3" / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, root / "qwen3-incomplete" / "model.safetensors")
    return root


BAD = {
    "top-k above the experts": ("qwen3", dict(experts=4, top_k=5), "top_k=5"),
    "no expert": ("qwen3", dict(experts=0, top_k=1), "experts=0"),
    "negative drop ratio": ("qwen3", dict(drop_ratio=-0.1), "drop_ratio=-0.1"),
    "drop ratio above 1": ("qwen3", dict(drop_ratio=1.5), "drop_ratio=1.5"),
    "a MoE model": ("qwen3-moe", {}, "qwen3_moe"),
    "an unsupported model": ("gpt2", {}, "gpt2"),
    "a shared expert for Qwen3": ("qwen3", dict(shared_experts=1), "shared_experts=1"),
    "two shared experts": ("llama", dict(shared_experts=2), "shared_experts=2"),
    "attention Qwen3-MoE cannot hold": ("qwen3-bias", {}, "attention.bias"),
    "quantized weights": ("qwen3-fp8", {}, "block-FP8"),
    "a missing tensor": ("qwen3-incomplete", {}, "missing tensor model.layers.1.mlp.up_proj.weight"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_request_that_cannot_be_met_is_one_line_exit_2_and_nothing_written(case, folders, tmp_path, capsys):
    source, options, named = BAD[case]
    capsys.readouterr()
    assert _upcycle(folders / source, tmp_path / "out", **options) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("upcycle: ") and named in err, err
    assert list(tmp_path.iterdir()) == []  # no output, no staging folder left behind


def test_an_existing_output_is_refused_unless_overwrite(folders, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    assert _upcycle(folders / "qwen3", tmp_path / "out") == 2
    assert "already exists" in capsys.readouterr().err and list((tmp_path / "out").iterdir()) == []
    assert _upcycle(folders / "qwen3", tmp_path / "out", overwrite=True) == 0
    assert hf.read_config(tmp_path / "out").family == "qwen3_moe"
