"""The dense families sparse upcycling starts from, Qwen3 and Llama, against transformers (fp32 on CPU): logits,
loss and every gradient of tiny random ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` models, the bit-exact
HF -> eqmoe -> HF round trip, the config allow-list and the published sizes' parameter counts."""

import pytest

from eqmoe.checkpoints import hf
from tests import hf_families as shared

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def perturb_norms_and_biases(name: str, tensor) -> None:
    """Norms off 1 and biases off 0 (transformers' initial values, at which a misplaced one goes unseen), and every
    matrix spread out (logits up to ~10, gradients up to ~1) so that a 1e-4 comparison means something."""
    if name.endswith(("norm.weight", ".bias")):
        tensor.add_(0.1 * torch.randn_like(tensor))
    elif tensor.ndim == 2:
        tensor.mul_(5.0)


_TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
QWEN3 = shared.Family("qwen3", transformers.Qwen3ForCausalLM, _TINY, perturb_norms_and_biases)
LLAMA = shared.Family("llama", transformers.LlamaForCausalLM, _TINY, perturb_norms_and_biases)
FAMILIES = {"qwen3": QWEN3, "llama": LLAMA}
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 5e5,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# Between them: tied and untied embeddings, biases on all four projections (with Qwen3's QK-norm after them), an
# explicit and a derived head_dim, plain and llama3-scaled RoPE, grouped queries with one and two key/value heads.
CASES = {
    "qwen3-untied-bias": ("qwen3", dict(attention_bias=True, num_key_value_heads=1)),
    "llama-tied-llama3-rope": ("llama", dict(tie_word_embeddings=True, head_dim=None, rope_parameters=_LLAMA3_ROPE)),
}


@pytest.fixture(params=list(CASES), name="case")
def _case(request, tmp_path):
    family_name, overrides = CASES[request.param]
    family = FAMILIES[family_name]
    family.save_tiny(tmp_path / "hf", seed=len(request.param), **overrides)
    return family, tmp_path / "hf"


def test_config_reads_as_the_dense_family(case):
    family, saved = case
    config = hf.read_config(saved)
    hf_config = family.model_class.config_class.from_pretrained(saved)
    assert config.family == family.name and set(config.ffn_kinds()) == {"dense"} and config.moe is None
    assert config.mlp_dim == hf_config.intermediate_size and config.tie_embeddings == hf_config.tie_word_embeddings
    assert config.attention.qk_norm == ("before_rope" if family is QWEN3 else "none")
    assert config.attention.bias == ("qkvo" if hf_config.attention_bias else "none")


def test_logits_loss_and_every_gradient_match_transformers(case):
    family, saved = case
    reference, model = family.reference(saved), hf.load(saved)
    shared.assert_logits_match(reference, model)
    out, loss, terms = shared.losses(reference, model)
    assert abs(float(loss) - out.loss.item()) <= 1e-5 and float(terms["cross_entropy"]) == float(loss), (loss, out.loss)
    ours, expected = shared.gradients(reference, model)
    shared.assert_gradients_match(ours, expected)
    assert shared.largest(ours, "mlp.") > 1e-3 and shared.largest(ours, "self_attn.") > 1e-3


def test_hf_to_eqmoe_to_hf_is_bit_exact(case, tmp_path):
    family, saved = case
    shared.assert_round_trip_bit_exact(family, saved, tmp_path / "back", derive_head_dim=family is LLAMA)
    assert shared.named_keys(family, saved) == set(hf.state_dict(hf.load(saved)))


@pytest.mark.parametrize(("preset", "family"), [("qwen3-8b", QWEN3), ("llama-3.1-8b", LLAMA)])
def test_published_parameter_counts_equal_transformers(preset, family, capsys):
    from eqmoe import presets

    written = hf_config_of(preset)
    total = shared.param_report(preset, capsys)["total"]
    assert total == shared.parameter_count(family.on_meta(family.model_class.config_class(**written)))
    assert {"llama-3.1-8b": 8_030_261_248, "qwen3-8b": 8_190_735_360}[preset] == total
    assert presets.get(preset).family == family.name


def hf_config_of(preset: str) -> dict:
    from eqmoe import presets
    from eqmoe.models import family as families

    config = presets.get(preset)
    written = families.get(config.family).config_to_hf(config)
    return {key: value for key, value in written.items() if key not in ("architectures", "model_type", "dtype")}


@pytest.mark.parametrize(
    ("name", "field", "value"),
    [
        ("qwen3", "use_sliding_window", True),
        ("qwen3", "layer_types", ["sliding_attention", "full_attention"]),
        ("qwen3", "head_dim", None),
        ("qwen3", "hidden_act", "gelu"),
        ("llama", "mlp_bias", True),
        ("llama", "attention_dropout", 0.1),
    ],
)
def test_what_changes_the_function_is_refused_in_one_line(tmp_path, name, field, value):
    family = FAMILIES[name]
    shared.assert_refused(tmp_path / "model", {**family.full_config(), field: value}, field)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_key_transformers_ignores_is_accepted_and_listed(tmp_path, capsys, name):
    shared.assert_ignored(
        tmp_path, {**FAMILIES[name].full_config(), "moe_intermediate_size": 8}, "moe_intermediate_size", capsys
    )


def test_qwen3_defaults_are_qwen3_configs(tmp_path):
    """Absent: head_dim 128 and 32 key/value heads (Qwen3Config's defaults, not derived); a null key/value head count
    is the head count."""
    full = {k: v for k, v in QWEN3.full_config().items() if k not in ("head_dim", "num_key_value_heads")}
    full.update(hidden_size=128, num_attention_heads=64)
    absent = hf.read_config(shared.write_config(tmp_path / "absent", full))
    expected = transformers.Qwen3Config(hidden_size=128, num_attention_heads=64)
    assert absent.attention.head_dim == expected.head_dim == 128
    assert absent.attention.num_kv_heads == expected.num_key_value_heads == 32
    null = hf.read_config(shared.write_config(tmp_path / "null", {**full, "num_key_value_heads": None}))
    expected = transformers.Qwen3Config(hidden_size=128, num_attention_heads=64, num_key_value_heads=None)
    assert null.attention.num_kv_heads == expected.num_key_value_heads == 64


# The Hub's config.json files, in transformers 4.x's keys (top-level rope_theta, rope_scaling, torch_dtype).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}


@pytest.mark.parametrize(("published", "preset"), [(QWEN3_8B, "qwen3-8b"), (LLAMA_3_1_8B, "llama-3.1-8b")])
def test_the_published_configs_read_as_the_presets_with_nothing_ignored(tmp_path, capsys, published, preset):
    from eqmoe import presets

    config = hf.read_config(shared.write_config(tmp_path, published))
    assert config == presets.get(preset).replace(param_dtype=config.param_dtype)
    assert "ignored" not in capsys.readouterr().err
