"""Mixtral parity with Hugging Face transformers (the numerical reference), fp32 on CPU: logits, losses and
gradients of tiny random MixtralForCausalLM models, HF -> eqmoe -> HF round trips, the config allow-list and
the 8x7B parameter count."""

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from eqmoe.checkpoints import hf
from tests import hf_families as shared

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
MIXTRAL = shared.Family("mixtral", transformers.MixtralForCausalLM, TINY)
saved = shared.saved_fixture(MIXTRAL, CASES)


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


def test_config_reads_as_mixtral(saved):
    config = hf.read_config(saved)
    hf_config = transformers.MixtralConfig.from_pretrained(saved)
    assert config.family == "mixtral" and config.attention.qk_norm == "none"
    assert set(config.ffn_kinds()) == {"moe"} and config.moe.router.renormalize
    assert config.attention.head_dim == (hf_config.head_dim or hf_config.hidden_size // hf_config.num_attention_heads)
    assert config.tie_embeddings == hf_config.tie_word_embeddings


def test_logits_match_transformers(saved):
    shared.assert_logits_match(MIXTRAL.reference(saved), hf.load(saved))


def test_loss_and_aux_loss_match_transformers(tmp_path):
    """HF's aux loss is ``load_balancing_loss_func`` (the same function as Qwen3-MoE's): eqmoe's ``hf_pooled``."""
    MIXTRAL.save_tiny(tmp_path, seed=3, router_aux_loss_coef=0.02)
    shared.assert_loss_and_aux_loss_match(MIXTRAL.reference(tmp_path), hf.load(tmp_path), weight=0.02)


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_torch(tmp_path, case):
    MIXTRAL.save_tiny(tmp_path, seed=4, router_aux_loss_coef=0.05, **CASES[case])
    ours, expected = shared.gradients(MIXTRAL.reference(tmp_path), hf.load(tmp_path), output_router_logits=True)
    shared.assert_gradients_match(ours, _hub_names(expected))
    assert shared.largest(ours, ".experts.") > 1e-3


def test_hf_to_eqmoe_to_hf_is_bit_exact(saved, tmp_path):
    shared.assert_round_trip_bit_exact(MIXTRAL, saved, tmp_path / "back", derive_head_dim=True)


def test_hub_key_names(saved):
    keys = set(load_file(saved / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.gate.weight" in keys
    assert {f"model.layers.2.block_sparse_moe.experts.3.{w}.weight" for w in ("w1", "w2", "w3")} <= keys
    assert shared.named_keys(MIXTRAL, saved) == keys


def test_mixtral_8x7b_parameter_count_equals_transformers(capsys):
    total = shared.param_report("mixtral-8x7b", capsys)["total"]
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
    assert total == shared.parameter_count(MIXTRAL.on_meta(config)) == 46_702_792_704


def test_every_field_transformers_writes_loads(tmp_path):
    config = hf.read_config(shared.write_config(tmp_path / "full", MIXTRAL.full_config()))
    assert config.attention.num_kv_heads == 2 and config.norm.eps == 1e-5 and config.attention.rope_theta == 1e4


@pytest.mark.parametrize(
    ("field", "value"),
    [("sliding_window", 4096), ("router_jitter_noise", 0.1), ("hidden_act", "gelu")],
)
def test_unsupported_field_is_refused_naming_field_and_file(tmp_path, field, value):
    shared.assert_refused(tmp_path / "model", {**MIXTRAL.full_config(), field: value}, field)


def test_save_refuses_what_mixtral_cannot_express(tmp_path):
    from eqmoe import Transformer

    MIXTRAL.save_tiny(tmp_path / "hf")
    config = hf.read_config(tmp_path / "hf")
    dense = config.replace(layers=tuple(["dense", "moe"]), mlp_dim=16)
    with pytest.raises(ValueError, match="layers"):
        hf.save(Transformer(dense, key=jax.random.key(0)), tmp_path / "out")


@pytest.mark.parametrize(("key", "value"), [("foo", 1)])
def test_a_key_transformers_ignores_is_accepted_and_listed(tmp_path, capsys, key, value):
    """Not a field of transformers' config for this model type: transformers ignores it; eqmoe too, saying so."""
    shared.assert_ignored(tmp_path, {**MIXTRAL.full_config(), key: value}, key, capsys)
