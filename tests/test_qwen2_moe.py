"""Qwen2-MoE parity with Hugging Face transformers (the numerical reference), fp32 on CPU: logits, losses and
gradients of tiny random Qwen2MoeForCausalLM models (q/k/v biases, the gated shared expert, dense layers by
mlp_only_layers and decoder_sparse_step), HF -> eqmoe -> HF round trips, the config allow-list and the published
parameter counts."""

import json
from dataclasses import replace

import numpy as np
import pytest
from safetensors.numpy import load_file

from eqmoe.checkpoints import hf
from eqmoe.models import family
from eqmoe.models.hf_config import _sparse_layout, layer_kinds_from_hf
from eqmoe.models.qwen2_moe import PRESETS
from tests import hf_families as shared

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
CASES = {
    # GQA, q/k/v biases, a dense layer between two MoE layers, raw top-k weights, untied, explicit head_dim
    # (wider than hidden_size // heads: transformers reads it although Qwen2MoeConfig does not declare it).
    "bias-dense-middle-untied": dict(mlp_only_layers=[1], head_dim=16, norm_topk_prob=False),
    # Every second layer MoE, one KV head, no biases, renormalised top-k, tied embeddings.
    "sparse-step-2-tied": dict(
        decoder_sparse_step=2,
        num_hidden_layers=4,
        num_key_value_heads=1,
        num_experts=6,
        num_experts_per_tok=3,
        qkv_bias=False,
        norm_topk_prob=True,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
}


def _perturb(name: str, tensor) -> None:
    """What initialisation leaves at a special value moved away from it: norms from 1, q/k/v biases from 0, the
    shared-expert gate from ~0 (so its sigmoid is not ~0.5 everywhere), and the router scaled up (clear top-k
    choices)."""
    if name.endswith("norm.weight"):
        tensor.add_(0.1 * torch.randn_like(tensor))
    elif name.endswith("_proj.bias"):
        tensor.copy_(0.2 * torch.randn_like(tensor))
    elif name.endswith("shared_expert_gate.weight"):
        tensor.copy_(0.5 * torch.randn_like(tensor))
    elif name.endswith("mlp.gate.weight"):
        tensor.mul_(5.0)


QWEN2_MOE = shared.Family("qwen2_moe", transformers.Qwen2MoeForCausalLM, TINY, _perturb)
saved = shared.saved_fixture(QWEN2_MOE, CASES)


def test_config_reads_as_qwen2_moe(saved):
    config = hf.read_config(saved)
    reference = QWEN2_MOE.reference(saved)
    hf_config = reference.config
    assert config.family == "qwen2_moe" and config.attention.qk_norm == "none"
    assert config.attention.bias == ("qkv" if hf_config.qkv_bias else "none")
    assert config.attention.head_dim == reference.model.layers[0].self_attn.head_dim
    moe = config.moe
    assert (moe.shared_experts, moe.shared_expert_dim, moe.shared_expert_gate) == (1, 40, True)
    assert moe.router.strategy == "softmax_top_k" and moe.router.renormalize == hf_config.norm_topk_prob
    kinds = ["moe" if hasattr(layer.mlp, "shared_expert") else "dense" for layer in reference.model.layers]
    assert list(config.ffn_kinds()) == kinds and "dense" in kinds
    assert config.tie_embeddings == hf_config.tie_word_embeddings


def test_logits_match_transformers(saved):
    shared.assert_logits_match(QWEN2_MOE.reference(saved), hf.load(saved))


def test_loss_and_aux_loss_match_transformers(tmp_path):
    """Qwen2-MoE's ``load_balancing_loss_func`` is Qwen3-MoE's and Mixtral's (pooled over the MoE layers and
    the unpadded tokens, times num_experts; the dense layers have no router logits): eqmoe's ``hf_pooled``."""
    QWEN2_MOE.save_tiny(tmp_path, seed=3, router_aux_loss_coef=0.02, **CASES["bias-dense-middle-untied"])
    out = shared.assert_loss_and_aux_loss_match(QWEN2_MOE.reference(tmp_path), hf.load(tmp_path), weight=0.02)
    assert len(out.router_logits) == 2  # the two MoE layers only


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_torch(tmp_path, case):
    """Initialised at std 0.02, many gradients are ~1e-5..1e-3, which the 1e-4 bar alone would pass even if
    wrong: each tensor also matches to 1e-4 of its own largest entry (fp32 gives ~1e-6)."""
    QWEN2_MOE.save_tiny(tmp_path, seed=4, router_aux_loss_coef=0.05, **CASES[case])
    reference = QWEN2_MOE.reference(tmp_path)
    ours, expected = shared.gradients(reference, hf.load(tmp_path), output_router_logits=True)
    shared.assert_gradients_match(ours, expected)
    for key, value in ours.items():
        scale = np.abs(expected[key]).max()
        assert np.abs(value - expected[key]).max() <= 1e-4 * scale + 1e-9, key
    for part in (".experts.", ".shared_expert.", ".shared_expert_gate.", "_proj.bias"):
        if part != "_proj.bias" or reference.config.qkv_bias:
            assert shared.largest(ours, part) > 1e-5, part


def test_hf_to_eqmoe_to_hf_is_bit_exact(saved, tmp_path):
    shared.assert_round_trip_bit_exact(QWEN2_MOE, saved, tmp_path / "back")


def test_hub_key_names(saved):
    keys = set(load_file(saved / "model.safetensors"))
    config = hf.read_config(saved)
    moe_layer = config.ffn_kinds().index("moe")
    prefix = f"model.layers.{moe_layer}.mlp."
    assert {f"{prefix}experts.3.{w}_proj.weight" for w in ("gate", "up", "down")} <= keys
    assert {f"{prefix}shared_expert.{w}_proj.weight" for w in ("gate", "up", "down")} <= keys
    assert {prefix + "gate.weight", prefix + "shared_expert_gate.weight"} <= keys
    assert ("model.layers.0.self_attn.q_proj.bias" in keys) == (config.attention.bias == "qkv")
    assert shared.named_keys(QWEN2_MOE, saved) == keys


@pytest.mark.parametrize(
    ("step", "mlp_only", "layers"),
    [(1, [], 3), (1, [1], 3), (2, [], 4), (2, [3], 6), (3, [], 6), (1, [0, 2], 4), (4, [], 4), (1, [5, 9], 4)],
)
def test_sparse_layout_reproduces_the_layer_kinds(step, mlp_only, layers):
    """config_to_hf writes (decoder_sparse_step, mlp_only_layers) that transformers turns into the same layers,
    and a layout transformers itself wrote (no redundant mlp_only_layers) unchanged."""
    kinds = tuple(layer_kinds_from_hf(layers, 8, step, mlp_only))
    if "moe" not in kinds:
        return
    written_step, written_mlp_only = _sparse_layout(kinds)
    assert tuple(layer_kinds_from_hf(layers, 8, written_step, written_mlp_only)) == kinds
    if not mlp_only:
        assert (written_step, written_mlp_only) == (step, [])


# Published sizes: the parameter counts of transformers' Qwen2MoeForCausalLM built from these on the meta device.
PUBLISHED = {
    "qwen1.5-moe-a2.7b": (
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=16,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            num_experts=60,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            max_position_embeddings=8192,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
        14_315_784_192,
    ),
    "qwen2-57b-a14b": (
        dict(
            vocab_size=151936,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            moe_intermediate_size=2560,
            shared_expert_intermediate_size=20480,
            num_experts=64,
            num_experts_per_tok=8,
            norm_topk_prob=False,
            max_position_embeddings=131072,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
        57_408_658_944,
    ),
}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_published_parameter_count_equals_transformers(preset, capsys):
    total = shared.param_report(preset, capsys)["total"]
    hf_fields, published = PUBLISHED[preset]
    model = QWEN2_MOE.on_meta(transformers.Qwen2MoeConfig(**hf_fields))
    assert total == shared.parameter_count(model) == published


# The Hub's config.json files, as published (transformers 4.39/4.40: top-level rope_theta, no qkv_bias).
QWEN2_57B_A14B_HUB = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "qwen2_moe",
    "moe_intermediate_size": 2560,
    "norm_topk_prob": False,
    "num_attention_heads": 28,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 20480,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN15_MOE_A27B_HUB = {
    **QWEN2_57B_A14B_HUB,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "max_position_embeddings": 8192,
    "max_window_layers": 21,
    "moe_intermediate_size": 1408,
    "num_attention_heads": 16,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 16,
    "shared_expert_intermediate_size": 5632,
    "sliding_window": 32768,
    "transformers_version": "4.39.0.dev0",
}


@pytest.mark.parametrize(
    ("preset", "hub"), [("qwen1.5-moe-a2.7b", QWEN15_MOE_A27B_HUB), ("qwen2-57b-a14b", QWEN2_57B_A14B_HUB)]
)
def test_hub_config_reads_as_the_preset(tmp_path, preset, hub):
    assert hf.read_config(shared.write_config(tmp_path / "hub", hub)) == PRESETS[preset]


@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_exports_and_reads_back(preset):
    """A preset's config.json is one transformers builds, and reads back as the preset."""
    qwen2_moe = family.get("qwen2_moe")
    written = qwen2_moe.config_to_hf(PRESETS[preset])
    assert (
        transformers.Qwen2MoeConfig(**written).shared_expert_intermediate_size
        == written["shared_expert_intermediate_size"]
    )
    assert qwen2_moe.config_from_hf(json.loads(json.dumps(written))) == PRESETS[preset]


def test_every_field_transformers_writes_loads(tmp_path):
    config = hf.read_config(shared.write_config(tmp_path / "full", QWEN2_MOE.full_config()))
    assert config.attention.bias == "qkv" and config.attention.head_dim == 8 and config.norm.eps == 1e-6
    assert not config.moe.router.renormalize and config.moe.shared_expert_dim == 40


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_sliding_window", True),
        ("layer_types", ["full_attention", "sliding_attention", "full_attention"]),
        ("shared_expert_intermediate_size", 0),
        ("hidden_act", "gelu"),
        ("qkv_bias", "yes"),
    ],
)
def test_unsupported_field_is_refused_naming_field_and_file(tmp_path, field, value):
    shared.assert_refused(tmp_path / "model", {**QWEN2_MOE.full_config(), field: value}, field)


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("attention.bias", lambda c: c.replace(attention=replace(c.attention, bias="qkvo"))),
        ("attention.qk_norm", lambda c: c.replace(attention=replace(c.attention, qk_norm="before_rope"))),
        ("moe.shared_expert_gate", lambda c: c.replace(moe=replace(c.moe, shared_expert_gate=False))),
        ("moe.shared_experts", lambda c: c.replace(moe=replace(c.moe, shared_experts=0, shared_expert_gate=False))),
    ],
)
def test_export_refuses_what_qwen2_moe_cannot_express(field, change):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        family.get("qwen2_moe").config_to_hf(change(PRESETS["qwen1.5-moe-a2.7b"]))


@pytest.mark.parametrize(("key", "value"), [("num_local_experts", 8), ("attention_bias", True), ("foo", 1)])
def test_a_key_transformers_ignores_is_accepted_and_listed(tmp_path, capsys, key, value):
    """Not a field of transformers' config for this model type: transformers ignores it; eqmoe too, saying so."""
    shared.assert_ignored(tmp_path, {**QWEN2_MOE.full_config(), key: value}, key, capsys)
