"""The Qwen3.5-MoE families: the text model (``model_type`` ``"qwen3_5_moe_text"``, transformers'
``Qwen3_5MoeForCausalLM``) and the published multimodal folders (``"qwen3_5_moe"``) whose language model it is.

The decoder is Qwen3-Next's (:mod:`eqmoe.models.qwen3_next`) with the linear attention's projections flat
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), every layer MoE and the router always renormalising.
Its multimodal RoPE (``mrope_section``) rotates text tokens exactly as partial RoPE does (their three position
components are equal), so a text model reads it as such.

A published folder is the multimodal model: ``config.json`` nests the language model's fields in ``text_config``
and the weights sit under ``model.language_model.*``, beside the vision tower ``model.visual.*`` and the
multi-token-prediction layer ``mtp.*``. Reading it loads the language model and skips (and lists) the rest, as
``Qwen3_5MoeForCausalLM`` does; images are not an input eqmoe takes. An export writes the language model in the same
layout (``text_config``, ``model.language_model.*``, no vision tower), which ``AutoModelForCausalLM`` loads.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from eqmoe.config import LayerKind, LinearAttentionConfig, ModelConfig
from eqmoe.models.family import TensorName
from eqmoe.models.field_map import FieldMap, Known, Rule, show
from eqmoe.models.hf_config import _integer, ignored_rope_keys, rope_rule
from eqmoe.models.qwen3_next import attention_kinds, hybrid, hybrid_family, hybrid_fields, hybrid_names, layer_types

TEXT, MULTIMODAL = "qwen3_5_moe_text", "qwen3_5_moe"


def _qwen3_5(family: str, **sizes) -> ModelConfig:
    linear = LinearAttentionConfig(
        key_heads=16, value_heads=sizes.pop("value_heads"), key_head_dim=128, value_head_dim=128, projection="flat"
    )
    return hybrid(
        vocab=248320,
        head_dim=256,
        kv_heads=2,
        linear=linear,
        mlp_dim=None,
        theta=1e7,
        family=family,
        mtp_layers=1,
        **sizes,
    )


# Qwen/Qwen3.5-35B-A3B config.json text_config: 40 layers (every 4th full attention), hidden 2048, 16 query and 2
# key/value heads of 256 (partial_rotary_factor 0.25, rope_theta 1e7), linear attention 16 key and 32 value heads of
# 128, 256 experts top-8 of width 512 and a shared expert of 512; vocabulary 248320; one multi-token-prediction layer.
_SIZES = {
    "qwen3.5-35b-a3b": dict(
        embed=2048, layers=40, heads=16, value_heads=32, experts=256, top_k=8, expert_dim=512, shared_dim=512
    ),
}
PRESETS: dict[str, ModelConfig] = {name: _qwen3_5(MULTIMODAL, **sizes) for name, sizes in _SIZES.items()}
TEXT_PRESETS: dict[str, ModelConfig] = {name + "-text": _qwen3_5(TEXT, **sizes) for name, sizes in _SIZES.items()}


def _layout_rule() -> Rule:
    """``num_hidden_layers`` and ``layer_types`` (or ``full_attention_interval``) <-> ``layers``, every one MoE."""

    def read(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        if "num_hidden_layers" not in hf:
            raise ValueError(f"{source}: missing field 'num_hidden_layers'")
        layers = _integer(hf, "num_hidden_layers", None, source)
        return {"layers": tuple(LayerKind(attention=kind, ffn="moe") for kind in attention_kinds(hf, source, layers))}

    def write(config: ModelConfig) -> dict[str, Any]:
        if any(layer.ffn != "moe" for layer in config.layers):
            raise ValueError("layers with dense FFNs have no Hugging Face Qwen3.5-MoE equivalent; allowed: moe")
        return {"num_hidden_layers": config.num_layers, "layer_types": layer_types(config, "Qwen3.5-MoE")}

    return Rule(("num_hidden_layers", "layer_types", "full_attention_interval"), ("layers",), read, write)


def _rope_rule() -> Rule:
    """Partial RoPE; the multimodal sections (``mrope_section``, ``mrope_interleaved``) are read and, for text, change
    nothing (not listed as ignored)."""
    rule = rope_rule(32768, "Qwen3.5-MoE", partial_default=0.25)
    mrope = ("mrope_section", "mrope_interleaved")
    return dataclasses.replace(rule, ignored=lambda hf: [k for k in ignored_rope_keys(hf) if not k.endswith(mrope)])


TEXT_FIELD_MAP = FieldMap(
    model_type=TEXT,
    architecture="Qwen3_5MoeForCausalLM",
    label="Qwen3.5-MoE",
    template=TEXT_PRESETS["qwen3.5-35b-a3b-text"],
    entries=(*hybrid_fields(248320, 256, 8, "Qwen3.5-MoE", rope=_rope_rule()), _layout_rule()),
)

# The multimodal config's own keys, none of which changes the language model.
_MULTIMODAL_KNOWN = (
    "vision_config",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)


class _MultimodalMap:
    """``config.json`` of the multimodal model: the language model's fields are ``text_config``'s (read and written
    by :data:`TEXT_FIELD_MAP`); its own keys are known; ``tie_word_embeddings`` is read at the top level too."""

    model_type = MULTIMODAL
    also_reads: tuple[str, ...] = ()
    architecture = "Qwen3_5MoeForConditionalGeneration"
    label = "Qwen3.5-MoE (multimodal)"

    @staticmethod
    def _text(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        if hf.get("model_type") != MULTIMODAL:
            raise ValueError(f"{source}: model_type {hf.get('model_type')!r} is not supported; allowed: {MULTIMODAL!r}")
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"{source}: text_config={show(text)} is invalid; allowed: a JSON object")
        return {**text, "model_type": TEXT}

    def read(self, hf: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        text = self._text(hf, source)
        if "tie_word_embeddings" in hf and "tie_word_embeddings" not in text:
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        return TEXT_FIELD_MAP.read(text, f"{source} (text_config)").replace(family=MULTIMODAL)

    def write(self, config: ModelConfig) -> dict[str, Any]:
        text = TEXT_FIELD_MAP.write(config.replace(family=TEXT))
        text.pop("architectures")
        return {
            "architectures": [self.architecture],
            "model_type": MULTIMODAL,
            "text_config": text,
            "tie_word_embeddings": config.tie_embeddings,
            "dtype": config.param_dtype,
        }

    def ignored_keys(self, hf: Mapping[str, Any]) -> list[str]:
        known = {*_MULTIMODAL_KNOWN, "text_config", "tie_word_embeddings", *Known(()).keys}
        known |= TEXT_FIELD_MAP.known_keys()
        outer = sorted(key for key in hf if key not in known)
        text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
        inner = TEXT_FIELD_MAP.ignored_keys({**text, "model_type": TEXT})
        return outer + [f"text_config.{key}" for key in inner]

    def check_expressible(self, config: ModelConfig) -> None:
        TEXT_FIELD_MAP.check_expressible(config.replace(family=TEXT))


MULTIMODAL_FIELD_MAP = _MultimodalMap()
_SKIPPED = (r"^model\.visual\.", r"^mtp\.")  # mtp.*: skipped only where the config declares no such layer


def multimodal_names(config: ModelConfig) -> list[TensorName]:
    return hybrid_names(config, base="model.language_model.")


TEXT_FAMILY = hybrid_family(TEXT, TEXT_PRESETS, TEXT_FIELD_MAP, hybrid_names, _SKIPPED)
FAMILY = hybrid_family(MULTIMODAL, PRESETS, MULTIMODAL_FIELD_MAP, multimodal_names, _SKIPPED)
