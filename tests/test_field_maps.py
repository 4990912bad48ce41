"""Every family's ``config.json`` as one declarative table: reading, writing and the allow-list come from it.

Real files carry keys transformers does not read for their ``model_type``: they load, listed on one "ignored" line,
as the published Qwen3-Coder-30B-A3B-Instruct ``config.json`` shows (its ``qkv_bias``, ``use_qk_norm`` and
``shared_expert_intermediate_size`` are not Qwen3MoeConfig's), with the parameter count transformers builds from
it. Every key transformers' config class defines is in its family's table (reproduced, fixed or known to change
nothing), so no key it reads can fall into the ignored list unnoticed.
"""

import json

import pytest

from eqmoe import presets
from eqmoe.analysis import count_parameters
from eqmoe.checkpoints import hf
from eqmoe.models import family as families

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

# huggingface.co/Qwen/Qwen3-Coder-30B-A3B-Instruct/blob/main/config.json, as published.
QWEN3_CODER_30B_A3B_INSTRUCT = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5472,
    "max_position_embeddings": 262144,
    "max_window_layers": 28,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "qkv_bias": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "router_aux_loss_coef": 0.0,
    "shared_expert_intermediate_size": 0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_qk_norm": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def _meta_parameters(architecture: str, hf_config: dict) -> int:
    """The parameter count of transformers' model for ``hf_config``, built on the meta device."""
    config = transformers.AutoConfig.for_model(**hf_config)
    with torch.device("meta"):
        model = getattr(transformers, architecture)(config)
    return sum(p.numel() for p in model.parameters())


def test_the_published_qwen3_coder_config_reads_listing_what_transformers_ignores(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_CODER_30B_A3B_INSTRUCT))
    config = hf.read_config(tmp_path)
    err = capsys.readouterr().err
    assert f"{tmp_path / 'config.json'}: ignored (transformers does not read them for qwen3_moe): " in err
    assert err.strip().endswith("qkv_bias, shared_expert_intermediate_size, use_qk_norm"), err
    assert config.attention.rope_theta == 1e7 and config.attention.qk_norm == "before_rope"
    assert config.moe.router.num_experts == 128 and config.moe.router.top_k == 8 and config.num_layers == 48
    total, _ = count_parameters(config)
    assert total == _meta_parameters("Qwen3MoeForCausalLM", QWEN3_CODER_30B_A3B_INSTRUCT) == 30_532_122_624


CONFIG_CLASSES = {
    "qwen3_moe": transformers.Qwen3MoeConfig,
    "mixtral": transformers.MixtralConfig,
    "olmoe": transformers.OlmoeConfig,
    "qwen2_moe": transformers.Qwen2MoeConfig,
    "glm4_moe": transformers.Glm4MoeConfig,
    "qwen3": transformers.Qwen3Config,
    "llama": transformers.LlamaConfig,
}


@pytest.mark.parametrize("name", sorted(CONFIG_CLASSES))
def test_every_key_the_transformers_config_defines_is_in_the_table(name):
    config_class = CONFIG_CLASSES[name]
    defined = set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {}))
    table = families.get(name).field_map
    assert defined <= table.known_keys(), sorted(defined - table.known_keys())
    assert families.get(name).ignored_keys(config_class().to_dict()) == []


@pytest.mark.parametrize(
    "name", ["qwen3-30b-a3b", "mixtral-8x7b", "olmoe-1b-7b", "qwen2-57b-a14b", "glm-4.5", "qwen3-8b", "llama-3.1-8b"]
)
def test_presets_write_and_read_back_through_the_table(name):
    config = presets.get(name)
    family = families.get(config.family)
    written = family.config_to_hf(config)
    assert family.ignored_keys(written) == []
    assert family.config_from_hf(written, "written") == config
