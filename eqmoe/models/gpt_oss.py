"""The gpt-oss family (Hugging Face ``model_type`` ``"gpt_oss"``): published presets, the ``config.json`` reader and
writer and the checkpoint name map.

gpt-oss is a pre-norm MoE decoder whose every layer routes, with these parts as eqmoe fields:

- attention: q/k/v/o projections with biases (``attention_bias``), no QK-norm, YaRN RoPE (``truncate: false``), a
  learned sink logit per head in every softmax (``AttentionConfig.sinks``), and ``layer_types`` alternating
  ``sliding_attention`` (a window of ``sliding_window`` keys: ``LayerKind.window``) and ``full_attention``;
- router: a linear gate with a bias (``RouterConfig.gate_bias``), the top-k logits softmaxed among themselves
  (``top_k_softmax``);
- experts: gate, up and down with biases (``MoEConfig.expert_bias``) and the clamped SwiGLU
  ``(clip(up, +-L) + 1) * g * sigmoid(alpha g)``, ``g = min(gate, L)`` (``clamped_swiglu``, ``swiglu_limit`` L,
  ``swiglu_alpha``), the fused ``gate_up_proj [E, hidden, 2I]`` interleaving gate (columns ``0::2``) and up
  (``1::2``);
- the auxiliary loss is transformers' pooled ``load_balancing_loss_func`` (eqmoe's ``hf_pooled``).

The published checkpoints store the experts in MXFP4 (:mod:`eqmoe.checkpoints.mxfp4`, dequantized while loading).
"""

from collections.abc import Mapping
from typing import Any

from eqmoe.config import (
    AttentionConfig,
    LayerKind,
    LossConfig,
    ModelConfig,
    MoEConfig,
    NormConfig,
    RopeScaling,
    RouterConfig,
)
from eqmoe.models.family import Family, TensorName, attention_names, layer_slots, linear_names, outer_names, register
from eqmoe.models.field_map import Field, FieldMap, Fixed, Rule, show
from eqmoe.models.hf_config import decoder_fields, on_off, rope_rule

NAME = "gpt_oss"
DEFAULT_THETA = 150000.0  # GptOssConfig.default_theta
# GptOssConfig's RoPE when a file names none
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
MAX_POSITIONS = 131072


def _yarn(max_positions: int = MAX_POSITIONS) -> RopeScaling:
    return RopeScaling(
        rope_type="yarn",
        factor=32.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        max_position_embeddings=max_positions,
    )


def alternating(layers: int, window: int) -> tuple[LayerKind, ...]:
    """transformers' default ``layer_types``: layer ``i`` slides when ``i`` is even, attends fully when odd."""
    return tuple(LayerKind("gqa", "moe", window if i % 2 == 0 else None) for i in range(layers))


def _gpt_oss(*, layers: int, experts: int, window: int = 128, vocab: int = 201088, embed: int = 2880) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        embed_dim=embed,
        attention=AttentionConfig(
            num_heads=64,
            num_kv_heads=8,
            head_dim=64,
            rope_theta=DEFAULT_THETA,
            rope_scaling=_yarn(),
            qk_norm="none",
            bias="qkvo",
            sinks=True,
        ),
        layers=alternating(layers, window),
        moe=MoEConfig(
            router=RouterConfig(num_experts=experts, top_k=4, strategy="top_k_softmax", gate_bias=True),
            expert_dim=2880,
            activation="clamped_swiglu",
            swiglu_alpha=1.702,
            swiglu_limit=7.0,
            expert_bias=True,
        ),
        norm=NormConfig(eps=1e-5, ffn_placement="pre"),
        loss=LossConfig(load_balance="hf_pooled", load_balance_weight=0.9),
        family=NAME,
    )


PRESETS: dict[str, ModelConfig] = {
    # openai/gpt-oss-20b and gpt-oss-120b config.json: 24 / 36 layers, 32 / 128 experts top-4, hidden 2880, 64
    # query and 8 key/value heads of 64, sliding window 128 on even layers, YaRN x32 over 4096 positions, rope_theta
    # 150000, router_aux_loss_coef 0.9, swiglu_limit 7.0, untied.
    "gpt-oss-20b": _gpt_oss(layers=24, experts=32),
    "gpt-oss-120b": _gpt_oss(layers=36, experts=128),
}


# --- Hugging Face config.json: transformers' GptOssConfig ------------------------------------------------


def _layers_read(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``num_hidden_layers`` + ``layer_types`` + ``sliding_window`` -> ``layers``: a ``sliding_attention`` layer
    sees ``sliding_window`` keys, a ``full_attention`` one every earlier key; without ``layer_types`` they alternate,
    sliding first (GptOssConfig)."""
    count = hf.get("num_hidden_layers")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{source}: num_hidden_layers={show(count)} is invalid; allowed: a positive integer")
    kinds = hf.get("layer_types")
    if kinds is None:
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(count)]
    allowed = ("sliding_attention", "full_attention")
    if not isinstance(kinds, list) or any(kind not in allowed for kind in kinds):
        raise ValueError(
            f'{source}: layer_types={show(kinds)} is invalid; allowed: a list of "{allowed[0]}" | "{allowed[1]}"'
        )
    if len(kinds) != count:
        raise ValueError(f"{source}: layer_types has {len(kinds)} entries; allowed: num_hidden_layers={count}")
    window = hf.get("sliding_window", 128)
    sliding = "sliding_attention" in kinds
    if sliding and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(
            f"{source}: sliding_window={show(window)} is invalid; allowed: a positive integer (layer_types has "
            "sliding_attention layers)"
        )
    return {"layers": tuple(LayerKind("gqa", "moe", window if kind == allowed[0] else None) for kind in kinds)}


def _layers_write(config: ModelConfig) -> dict[str, Any]:
    windows = {layer.window for layer in config.layers} - {None}
    plain = all(layer == LayerKind("gqa", "moe", layer.window) for layer in config.layers)
    if not plain or len(windows) > 1:
        raise ValueError(
            f"layers={config.layers!r} has no Hugging Face gpt-oss equivalent; allowed: gqa attention and moe FFN in "
            "every layer, one sliding window"
        )
    return {
        "num_hidden_layers": config.num_layers,
        "layer_types": ["full_attention" if layer.window is None else "sliding_attention" for layer in config.layers],
        "sliding_window": windows.pop() if windows else None,
    }


def _rope_rule() -> Rule:
    """:func:`eqmoe.models.hf_config.rope_rule` with GptOssConfig's defaults: YaRN x32 when the file names no RoPE,
    ``rope_theta`` 150000 when it names none."""
    rule = rope_rule(MAX_POSITIONS, "gpt-oss")

    def read(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        hf = dict(hf)
        if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
            hf["rope_parameters"] = DEFAULT_ROPE
        params = hf.get("rope_scaling") or hf.get("rope_parameters")
        if isinstance(params, dict) and "rope_theta" not in params and "rope_theta" not in hf:
            hf["rope_theta"] = DEFAULT_THETA
        return rule.read(hf, source)

    return Rule(rule.keys, rule.paths, read, rule.write, ignored=rule.ignored)


FIELD_MAP = FieldMap(
    model_type=NAME,
    architecture="GptOssForCausalLM",
    label="gpt-oss",
    template=PRESETS["gpt-oss-20b"],
    entries=(
        # GptOssConfig: 8 key/value heads and head_dim 64 when absent; its strict dataclass refuses a null
        *decoder_fields(kv_default=8, eps=1e-5, head_dim_default=64, nullable=False),
        Field("intermediate_size", "moe.expert_dim", kind="positive"),
        Field("num_local_experts", "moe.router.num_experts", 128, kind="positive", aliases=("num_experts",)),
        Field("num_experts_per_tok", "moe.router.top_k", 4, kind="positive"),
        Field("router_aux_loss_coef", "loss.load_balance_weight", 0.001, kind="number", read=float),
        Field("swiglu_limit", "moe.swiglu_limit", 7.0, kind="positive_number", read=float),
        Field("swiglu_alpha", "moe.swiglu_alpha", 1.702, kind="positive_number", read=float),
        Field(
            "attention_bias",
            "attention.bias",
            True,
            kind="bool",
            read=lambda on: "qkvo" if on else "none",
            write=on_off("qkvo", "none", "attention_bias: q, k, v and o"),
        ),
        Rule(("num_hidden_layers", "layer_types", "sliding_window"), ("layers",), _layers_read, _layers_write),
        _rope_rule(),
        Fixed("hidden_act", "silu"),
        Fixed("attention_dropout", 0.0),
    ),
)


# --- Checkpoint name map ---------------------------------------------------------------------------


def checkpoint_names(config: ModelConfig) -> list[TensorName]:
    """Every tensor of a Hugging Face gpt-oss checkpoint for ``config`` as transformers saves it unquantized: the
    decoder's norms and attention (q/k/v/o with biases, ``sinks``), ``mlp.router.weight``/``bias`` and the stacked
    experts ``mlp.experts.gate_up_proj [E, hidden, 2I]`` (gate at columns ``0::2``, up at ``1::2``) with
    ``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, hidden]`` and ``down_proj_bias [E, hidden]``."""
    names = outer_names(config)
    for layer, s, r, u, kind in layer_slots(config):
        block, prefix = ("segments", s, "blocks", u), f"model.layers.{layer}."
        names += attention_names(prefix, block, r, config, kind)
        ffn, mlp = (*block, "ffn"), prefix + "mlp."
        names += linear_names(mlp + "router", (*ffn, "router", "gate"), (r,), bias=True)
        experts = (*ffn, "experts")
        for part, start in (("gate", 0), ("up", 1)):
            names.append(TensorName(mlp + "experts.gate_up_proj", (*experts, part, "weight"), (r,), columns=(start, 2)))
            names.append(
                TensorName(mlp + "experts.gate_up_proj_bias", (*experts, part, "bias"), (r,), columns=(start, 2))
            )
        names.append(TensorName(mlp + "experts.down_proj", (*experts, "down", "weight"), (r,)))
        names.append(TensorName(mlp + "experts.down_proj_bias", (*experts, "down", "bias"), (r,)))
    return names


FAMILY = register(
    Family(name=NAME, presets=PRESETS, hf_model_type=NAME, field_map=FIELD_MAP, checkpoint_names=checkpoint_names)
)
