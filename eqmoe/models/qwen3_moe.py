"""The Qwen3-MoE family: published presets, the Hugging Face ``config.json`` reader and writer and the
checkpoint name map."""

from typing import Any

from eqmoe.config import (
    AttentionConfig,
    LossConfig,
    ModelConfig,
    MoEConfig,
    NormConfig,
    RopeScaling,
    RouterConfig,
)
from eqmoe.models.family import (
    Family,
    TensorName,
    attention_names,
    layer_slots,
    outer_names,
    register,
    swiglu_names,
)
from eqmoe.models.field_map import Field, FieldMap, Fixed, Known
from eqmoe.models.hf_config import decoder_fields, rope_rule, sparse_layout_rule

NAME = "qwen3_moe"


def _qwen3_moe(
    *,
    vocab: int,
    embed: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    experts: int,
    top_k: int,
    expert_dim: int,
    mlp_dim: int,
    theta: float,
    rope_scaling: RopeScaling | None = None,
    kinds: list[str] | None = None,
    tie: bool = False,
    renormalize: bool = True,
    eps: float = 1e-6,
    block_size: int = 64,
    aux_coef: float = 0.001,
) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        embed_dim=embed,
        attention=AttentionConfig(
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta, rope_scaling=rope_scaling
        ),
        layers=tuple(kinds or ["moe"] * layers),
        mlp_dim=mlp_dim,
        moe=MoEConfig(
            router=RouterConfig(num_experts=experts, top_k=top_k, renormalize=renormalize),
            expert_dim=expert_dim,
            block_size=block_size,
        ),
        norm=NormConfig(eps=eps, ffn_placement="pre"),
        loss=LossConfig(load_balance="hf_pooled", load_balance_weight=aux_coef),
        tie_embeddings=tie,
        family=NAME,
    )


_30B = dict(
    vocab=151936,
    embed=2048,
    layers=48,
    heads=32,
    kv_heads=4,
    head_dim=128,
    experts=128,
    top_k=8,
    expert_dim=768,
    mlp_dim=6144,
)
_235B = dict(
    vocab=151936,
    embed=4096,
    layers=94,
    heads=64,
    kv_heads=4,
    head_dim=128,
    experts=128,
    top_k=8,
    expert_dim=1536,
    mlp_dim=12288,
)

PRESETS: dict[str, ModelConfig] = {
    "qwen3-30b-a3b": _qwen3_moe(**_30B, theta=1e6),
    "qwen3-30b-a3b-2507": _qwen3_moe(**_30B, theta=1e7),
    "qwen3-235b-a22b": _qwen3_moe(**_235B, theta=1e6),
    "qwen3-235b-a22b-2507": _qwen3_moe(**_235B, theta=5e6),
    # CPU-sized models with the same structure: byte-level vocabulary plus room for special tokens.
    "qwen3-moe-micro": _qwen3_moe(
        vocab=512,
        embed=64,
        layers=4,
        heads=4,
        kv_heads=2,
        head_dim=16,
        experts=8,
        top_k=2,
        expert_dim=64,
        mlp_dim=128,
        theta=1e4,
    ),
    "qwen3-moe-tiny": _qwen3_moe(
        vocab=512,
        embed=128,
        layers=4,
        heads=4,
        kv_heads=2,
        head_dim=32,
        experts=8,
        top_k=2,
        expert_dim=128,
        mlp_dim=256,
        theta=1e4,
    ),
}


# --- Hugging Face config.json: transformers' Qwen3MoeConfig ----------------------------------------------

_DEFAULT_MAX_POSITIONS = 32768  # Qwen3MoeConfig.max_position_embeddings


def _experts(hf) -> object:
    return hf.get("num_experts", hf.get("num_local_experts", 128))


FIELD_MAP = FieldMap(
    model_type=NAME,
    architecture="Qwen3MoeForCausalLM",
    label="Qwen3-MoE",
    template=PRESETS["qwen3-moe-micro"],
    entries=(
        *decoder_fields(),
        Field("intermediate_size", "mlp_dim", None, kind="positive"),
        Field("moe_intermediate_size", "moe.expert_dim", kind="positive"),
        # required, as the widths are: a truncated file is never read as Qwen3MoeConfig's 128 experts
        Field("num_experts", "moe.router.num_experts", kind="positive", aliases=("num_local_experts",)),
        Field("num_experts_per_tok", "moe.router.top_k", kind="positive"),
        Field("norm_topk_prob", "moe.router.renormalize", False, kind="bool"),
        Field("router_aux_loss_coef", "loss.load_balance_weight", 0.001, kind="number", read=float),
        sparse_layout_rule(_experts, "Qwen3-MoE"),
        rope_rule(_DEFAULT_MAX_POSITIONS, "Qwen3-MoE"),
        Fixed("hidden_act", "silu"),
        Fixed("attention_bias", False),
        Fixed("use_sliding_window", False),
        Fixed("attention_dropout", 0.0),
        # read by transformers only with use_sliding_window (it sets them to None otherwise)
        Known(("sliding_window", "max_window_layers")),
    ),
)


def config_from_hf(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face Qwen3-MoE ``config.json`` dictionary (:data:`FIELD_MAP`)."""
    return FIELD_MAP.read(hf, source)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dictionary for ``config``; a ``ValueError`` names the first field
    that transformers' Qwen3-MoE cannot express (:data:`FIELD_MAP`)."""
    return FIELD_MAP.write(config)


# --- Checkpoint name map ---------------------------------------------------------------------------


def checkpoint_names(config: ModelConfig) -> list[TensorName]:
    """Every tensor of a Hugging Face Qwen3-MoE checkpoint for ``config``, in the Hub's key names."""
    names = outer_names(config)
    num_experts = config.moe.router.num_experts if config.moe else 0
    for layer, s, r, u, kind in layer_slots(config):
        block = ("segments", s, "blocks", u)
        prefix = f"model.layers.{layer}."
        names += attention_names(prefix, block, r, config, kind)
        if kind.ffn == "dense":
            names += swiglu_names(prefix + "mlp.", (*block, "ffn"), (r,))
            continue
        names.append(TensorName(prefix + "mlp.gate.weight", (*block, "ffn", "router", "gate", "weight"), (r,), 1))
        for j in range(num_experts):
            names += swiglu_names(prefix + f"mlp.experts.{j}.", (*block, "ffn", "experts"), (r, j))
    return names


FAMILY = register(
    Family(
        name=NAME,
        presets=PRESETS,
        hf_model_type=NAME,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        field_map=FIELD_MAP,
        checkpoint_names=checkpoint_names,
    )
)
