"""Mixtral parity with Hugging Face transformers (the numerical reference), fp32 on CPU: logits, losses and
gradients of tiny random MixtralForCausalLM models, HF -> eqmoe -> HF round trips, the config allow-list and
the 8x7B parameter count."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from eqmoe.checkpoints import hf
from eqmoe.models import family
from experiments.param_report import Args, main
from tests.test_qwen3_parity import _our_loss, _reference_gradients

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
CASES = {  # GQA both; 4 experts untied with an explicit head_dim, 8 experts tied with the derived head_dim
    "4-experts-untied": {},
    "8-experts-tied": dict(
        num_local_experts=8,
        num_key_value_heads=1,
        head_dim=None,
        hidden_size=48,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
}
SEQ = 300


def save_tiny_mixtral(folder: Path, seed: int = 0, **overrides):
    """A random ``MixtralForCausalLM`` saved to ``folder`` with its norms perturbed away from exactly 1."""
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder)


def load_mixtral_reference(folder: Path):
    return transformers.MixtralForCausalLM.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager"
    ).eval()


def _padded_batch(vocab: int, seq: int = SEQ):
    """Right-padded rows of different lengths, as a tokenizer with padding would give."""
    ids = torch.randint(0, vocab, (3, seq), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, seq - 70 :] = 0
    mask[2, 40:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _hub_names(grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Qwen-style names (from the shared helper) to Mixtral's Hub names: gate/up/down = w1/w3/w2."""
    renames = {
        ".mlp.gate.": ".block_sparse_moe.gate.",
        ".gate_proj.": ".w1.",
        ".up_proj.": ".w3.",
        ".down_proj.": ".w2.",
        ".mlp.experts.": ".block_sparse_moe.experts.",
    }
    out = {}
    for key, value in grads.items():
        for old, new in renames.items():
            key = key.replace(old, new)
        out[key] = value
    return out


@pytest.fixture(params=list(CASES))
def saved(request, tmp_path):
    save_tiny_mixtral(tmp_path, seed=len(request.param), **CASES[request.param])
    return tmp_path


def test_config_reads_as_mixtral(saved):
    config = hf.read_config(saved)
    hf_config = transformers.MixtralConfig.from_pretrained(saved)
    assert config.family == "mixtral" and config.attention.qk_norm == "none"
    assert set(config.layer_kinds()) == {"moe"} and config.moe.router.renormalize
    assert config.attention.head_dim == (hf_config.head_dim or hf_config.hidden_size // hf_config.num_attention_heads)
    assert config.tie_embeddings == hf_config.tie_word_embeddings


def test_logits_match_transformers(saved):
    reference = load_mixtral_reference(saved)
    model = hf.load(saved)
    ids = torch.randint(0, reference.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits.numpy()
    logits = np.asarray(model(jnp.asarray(ids.numpy())).logits)
    assert logits.shape == expected.shape
    assert np.abs(logits - expected).max() <= 1e-4


def test_loss_and_aux_loss_match_transformers(tmp_path):
    """HF's aux loss is ``load_balancing_loss_func`` (the same function as Qwen3-MoE's): eqmoe's ``hf_pooled``."""
    save_tiny_mixtral(tmp_path, seed=3, router_aux_loss_coef=0.02)
    reference = load_mixtral_reference(tmp_path)
    model = hf.load(tmp_path)
    assert model.config.loss.load_balance == "hf_pooled" and model.config.loss.load_balance_weight == 0.02
    ids, mask, labels = _padded_batch(reference.config.vocab_size)
    with torch.no_grad():
        out = reference(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    loss, terms = _our_loss(model, ids, mask)(model)
    np.testing.assert_allclose(float(terms["load_balance"]), out.aux_loss.item(), rtol=1e-5)
    np.testing.assert_allclose(float(loss), out.loss.item(), rtol=1e-5)
    hf_cross_entropy = out.loss.item() - 0.02 * out.aux_loss.item()
    np.testing.assert_allclose(float(terms["cross_entropy"]), hf_cross_entropy, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_torch(tmp_path, case):
    save_tiny_mixtral(tmp_path, seed=4, router_aux_loss_coef=0.05, **CASES[case])
    reference = load_mixtral_reference(tmp_path)
    model = hf.load(tmp_path)
    ids, mask, labels = _padded_batch(reference.config.vocab_size, seq=64)
    reference(ids, attention_mask=mask, labels=labels, output_router_logits=True).loss.backward()
    expected = _hub_names(_reference_gradients(reference))
    if reference.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)  # the same tensor as the embedding (its gradient is the sum)

    grads, _ = jax.grad(_our_loss(model, ids, mask), has_aux=True)(model)
    ours = hf.state_dict(grads)
    assert set(ours) == set(expected)
    for key, value in ours.items():
        np.testing.assert_allclose(value, expected[key], atol=1e-4, rtol=0, err_msg=key)
    assert max(np.abs(v).max() for k, v in ours.items() if ".experts." in k) > 1e-3


def _transformers_config(folder: Path) -> dict:
    config = transformers.MixtralConfig.from_pretrained(folder).to_dict()
    config.pop("_name_or_path", None)
    config["head_dim"] = config["head_dim"] or config["hidden_size"] // config["num_attention_heads"]
    return config


def test_hf_to_eqmoe_to_hf_is_bit_exact(saved, tmp_path):
    hf.save(hf.load(saved), tmp_path / "back")
    original, back = load_file(saved / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert set(original) == set(back)
    for key, value in original.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)
    assert _transformers_config(tmp_path / "back") == _transformers_config(saved)
    assert hf.read_config(tmp_path / "back") == hf.read_config(saved)


def test_hub_key_names(saved):
    keys = set(load_file(saved / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.gate.weight" in keys
    assert {f"model.layers.2.block_sparse_moe.experts.3.{w}.weight" for w in ("w1", "w2", "w3")} <= keys
    assert {name.key for name in family.get("mixtral").checkpoint_names(hf.read_config(saved))} == keys


def test_mixtral_8x7b_parameter_count_equals_transformers(capsys):
    assert main(Args(preset="mixtral-8x7b", json=True)) == 0
    total = json.loads(capsys.readouterr().out)["total"]
    config = transformers.MixtralConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    with torch.device("meta"):
        expected = sum(p.numel() for p in transformers.MixtralForCausalLM(config).parameters())
    assert total == expected == 46_702_792_704


def _write(folder: Path, config: dict) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _full_config(**overrides) -> dict:
    """Every field transformers' MixtralConfig serialises, defaults included (``use_diff=False``)."""
    return json.loads(transformers.MixtralConfig(**{**TINY, **overrides}).to_json_string(use_diff=False))


def test_every_field_transformers_writes_loads(tmp_path):
    config = hf.read_config(_write(tmp_path / "full", _full_config()))
    assert config.attention.num_kv_heads == 2 and config.norm.eps == 1e-5 and config.attention.rope_theta == 1e4


@pytest.mark.parametrize(
    ("field", "value"),
    [("sliding_window", 4096), ("router_jitter_noise", 0.1), ("hidden_act", "gelu"), ("foo", 1)],
)
def test_unsupported_field_is_refused_naming_field_and_file(tmp_path, field, value):
    folder = _write(tmp_path / "model", {**_full_config(), field: value})
    with pytest.raises(ValueError) as excinfo:
        hf.read_config(folder)
    message = str(excinfo.value)
    assert "\n" not in message and message.count(str(folder / "config.json")) == 1, message
    assert field in message


def test_save_refuses_what_mixtral_cannot_express(tmp_path):
    from eqmoe import Transformer
    from eqmoe.config import segments_from_kinds

    save_tiny_mixtral(tmp_path / "hf")
    config = hf.read_config(tmp_path / "hf")
    dense = config.replace(layers=segments_from_kinds(["dense", "moe"]), mlp_dim=16)
    with pytest.raises(ValueError, match="layers"):
        hf.save(Transformer(dense, key=jax.random.key(0)), tmp_path / "out")
