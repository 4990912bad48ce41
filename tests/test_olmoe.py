"""OLMoE parity with Hugging Face transformers (the numerical reference), fp32 on CPU: logits, losses and
gradients of tiny random OlmoeForCausalLM models (projection-wide QK-norm, q/k/v/o biases, clip_qkv exercised,
renormalised and raw top-k weights, tied and untied), HF -> eqmoe -> HF round trips, the config allow-list and
the OLMoE-1B-7B parameter count."""

import dataclasses

import numpy as np
import pytest
from safetensors.numpy import load_file

from eqmoe.checkpoints import hf
from eqmoe.models import olmoe
from tests import hf_families as shared

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=False,
    attention_bias=True,
    clip_qkv=1.5,  # low enough that some q, k and v entries are clamped (checked below)
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
CASES = {
    # GQA, raw top-k weights (as OLMoE-1B-7B), untied, biases on q/k/v/o, clip_qkv active
    "gqa-bias-clip": {},
    # MHA (as OLMoE-1B-7B), renormalised top-k, tied, no bias, no clip, another theta, 8 experts top-3
    "tied-renormalized": dict(
        hidden_size=48,
        num_key_value_heads=4,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        tie_word_embeddings=True,
        attention_bias=False,
        clip_qkv=None,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    ),
}


def _perturb(name: str, tensor) -> None:
    """Norms moved off 1, biases off 0 (HF initialises them at 0), and v_proj scaled up so that ``clip_qkv``
    clamps values too, not only q and k."""
    if name.endswith(("norm.weight", ".bias")):
        tensor.add_(0.1 * torch.randn_like(tensor))
    elif name.endswith("v_proj.weight"):
        tensor.mul_(10.0)


OLMOE = shared.Family("olmoe", transformers.OlmoeForCausalLM, TINY, _perturb)
saved = shared.saved_fixture(OLMOE, CASES)


def _record_pre_clip(reference) -> dict[str, list[torch.Tensor]]:
    """q, k and v of every layer as OlmoeAttention clamps them (q_norm, k_norm and v_proj outputs): forward hooks
    that copy them before the in-place clamp."""
    seen = {"q": [], "k": [], "v": []}
    for layer in reference.model.layers:
        attention = layer.self_attn
        for which, module in (("q", attention.q_norm), ("k", attention.k_norm), ("v", attention.v_proj)):
            module.register_forward_hook(lambda _m, _i, out, which=which: seen[which].append(out.detach().clone()))
    return seen


def test_config_reads_as_olmoe(saved):
    config = hf.read_config(saved)
    reference = transformers.OlmoeConfig.from_pretrained(saved)
    attention = config.attention
    assert config.family == "olmoe" and set(config.ffn_kinds()) == {"moe"}
    assert (attention.qk_norm, attention.qk_norm_scope) == ("before_rope", "projection")
    assert attention.head_dim == reference.hidden_size // reference.num_attention_heads
    assert attention.bias == ("qkvo" if reference.attention_bias else "none")
    assert attention.clip_qkv == reference.clip_qkv
    assert config.moe.router.strategy == "softmax_top_k" and config.moe.router.renormalize == reference.norm_topk_prob
    assert config.tie_embeddings == reference.tie_word_embeddings
    assert config.loss.load_balance == "hf_pooled" and config.loss.load_balance_weight == 0.01


def test_logits_match_transformers(saved):
    reference = OLMOE.reference(saved)
    seen = _record_pre_clip(reference)
    shared.assert_logits_match(reference, hf.load(saved))
    clip = reference.config.clip_qkv
    if clip is not None:  # the clamp changed q, k and v somewhere, and left most entries alone
        for which, outputs in seen.items():
            over = torch.cat([out.abs().flatten() for out in outputs]) > clip
            assert 0 < over.float().mean() < 0.5, which


def test_loss_and_aux_loss_match_transformers(tmp_path):
    """HF's aux loss is ``load_balancing_loss_func`` (Mixtral's and Qwen3-MoE's): eqmoe's ``hf_pooled``."""
    OLMOE.save_tiny(tmp_path, seed=3, router_aux_loss_coef=0.02)
    shared.assert_loss_and_aux_loss_match(OLMOE.reference(tmp_path), hf.load(tmp_path), weight=0.02)


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_torch(tmp_path, case):
    """Every parameter's gradient to 1e-4, but one embedding row: OlmoeConfig's ``pad_token_id`` (1) is the
    ``padding_idx`` of transformers' ``nn.Embedding``, whose lookup gradient torch zeroes; eqmoe has no frozen
    row, so where the pad id occurs as an unmasked input (random ids here) that row's gradient differs."""
    OLMOE.save_tiny(tmp_path, seed=4, router_aux_loss_coef=0.05, **CASES[case])
    reference = OLMOE.reference(tmp_path)
    ids, mask, _ = shared.padded_batch(reference.config.vocab_size, seq=64)
    pad = reference.config.pad_token_id
    assert pad == 1 and bool((ids[mask.bool()] == pad).any())
    ours, expected = shared.gradients(reference, hf.load(tmp_path), output_router_logits=True)
    embed, rows = "model.embed_tokens.weight", np.arange(reference.config.vocab_size) != pad
    shared.assert_gradients_match({**ours, embed: ours[embed][rows]}, {**expected, embed: expected[embed][rows]})
    experts = [k for k in ours if ".experts." in k]  # small here (2e-4 to 4e-4), so check them far below that
    assert max(np.abs(ours[k]).max() for k in experts) > 1e-4
    assert max(np.abs(ours[k] - expected[k]).max() for k in experts) <= 1e-6
    if reference.config.attention_bias:
        assert min(np.abs(ours[f"model.layers.0.self_attn.{p}_proj.bias"]).max() for p in "qkvo") > 1e-4
    if not reference.config.tie_word_embeddings:  # the one difference: torch's frozen padding row
        assert np.all(expected[embed][pad] == 0)


def test_hf_to_eqmoe_to_hf_is_bit_exact(saved, tmp_path):
    shared.assert_round_trip_bit_exact(OLMOE, saved, tmp_path / "back")


def test_hub_key_names(saved):
    """transformers 5 keeps the experts fused in memory but ``save_pretrained`` writes them per expert, in the
    Hub's names (its ``qwen2_moe`` conversion mapping), with projection-sized q_norm/k_norm."""
    tensors = load_file(saved / "model.safetensors")
    config = transformers.OlmoeConfig.from_pretrained(saved)
    assert "model.layers.0.mlp.gate.weight" in tensors and "model.layers.0.mlp.experts.gate_up_proj" not in tensors
    assert {f"model.layers.2.mlp.experts.3.{p}_proj.weight" for p in ("gate", "up", "down")} <= set(tensors)
    head_dim = config.hidden_size // config.num_attention_heads
    assert tensors["model.layers.1.self_attn.q_norm.weight"].shape == (config.hidden_size,)
    assert tensors["model.layers.1.self_attn.k_norm.weight"].shape == (config.num_key_value_heads * head_dim,)
    assert ("model.layers.0.self_attn.o_proj.bias" in tensors) == config.attention_bias
    assert shared.named_keys(OLMOE, saved) == set(tensors)


# allenai/OLMoE-1B-7B-0924 config.json (written by transformers 4.43: top-level rope_theta, rope_scaling null).
HUB_CONFIG = {
    "architectures": ["OlmoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "clip_qkv": None,
    "eos_token_id": 50279,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 1024,
    "max_position_embeddings": 4096,
    "model_type": "olmoe",
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 16,
    "num_key_value_heads": 16,
    "output_router_logits": False,
    "pad_token_id": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "router_aux_loss_coef": 0.01,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 50304,
}


def test_hub_config_reads_as_the_preset():
    assert olmoe.config_from_hf(HUB_CONFIG) == olmoe.PRESETS["olmoe-1b-7b"]


def test_olmoe_1b_7b_parameter_count_equals_transformers(capsys):
    total = shared.param_report("olmoe-1b-7b", capsys)["total"]
    config = transformers.OlmoeConfig(
        vocab_size=50304,
        hidden_size=2048,
        intermediate_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=64,
        num_experts_per_tok=8,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )
    assert total == shared.parameter_count(OLMOE.on_meta(config)) == 6_919_161_856


def test_every_field_transformers_writes_loads(tmp_path):
    config = hf.read_config(shared.write_config(tmp_path / "full", OLMOE.full_config()))
    assert config.attention.num_kv_heads == 2 and config.norm.eps == 1e-5 and config.attention.rope_theta == 1e4
    assert config.attention.clip_qkv == 1.5 and config.attention.bias == "qkvo"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("head_dim", 16),  # transformers' q_norm (hidden_size) would not fit 4 heads of 16
        ("num_attention_heads", 5),  # 32 is not a multiple of 5
        ("clip_qkv", -1.0),
        ("hidden_act", "gelu"),
        ("attention_dropout", 0.1),
    ],
)
def test_unsupported_field_is_refused_naming_field_and_file(tmp_path, field, value):
    shared.assert_refused(tmp_path / "model", {**OLMOE.full_config(), field: value}, field)


def test_head_dim_equal_to_the_derived_one_loads(tmp_path):
    config = hf.read_config(shared.write_config(tmp_path / "model", {**OLMOE.full_config(), "head_dim": 8}))
    assert config.attention.head_dim == 8


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("attention.qk_norm_scope", dict(qk_norm_scope="head")),  # Qwen3's per-head QK-norm
        ("attention.head_dim", dict(head_dim=16)),
        ("attention.bias", dict(bias="qkv")),  # attention_bias is one switch for q, k, v and o
    ],
)
def test_save_refuses_what_olmoe_cannot_express(field, change):
    config = olmoe.config_from_hf(OLMOE.full_config())
    changed = config.replace(attention=dataclasses.replace(config.attention, **change))
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        olmoe.config_to_hf(changed)


def test_save_refuses_dense_layers():

    config = olmoe.config_from_hf(OLMOE.full_config())
    dense = config.replace(layers=tuple(["dense", "moe"]), mlp_dim=16)
    with pytest.raises(ValueError, match="layers"):
        olmoe.config_to_hf(dense)


@pytest.mark.parametrize(("key", "value"), [("router_z_loss_coef", 0.001), ("foo", 1)])
def test_a_key_transformers_ignores_is_accepted_and_listed(tmp_path, capsys, key, value):
    """Not a field of transformers' config for this model type: transformers ignores it; eqmoe too, saying so."""
    shared.assert_ignored(tmp_path, {**OLMOE.full_config(), key: value}, key, capsys)
