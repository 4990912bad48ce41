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
    segments_from_kinds,
)
from eqmoe.models import hf_config
from eqmoe.models.family import (
    Family,
    TensorName,
    attention_names,
    layer_slots,
    outer_names,
    register,
    swiglu_names,
)
from eqmoe.models.hf_config import COMMON_IRRELEVANT_FIELDS, FieldList, positive_integers, require, rope_to_hf

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
        layers=segments_from_kinds(kinds or ["moe"] * layers),
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


# --- Hugging Face config.json -------------------------------------------------------------------

# Every field a Qwen3-MoE config.json may hold (transformers' Qwen3MoeConfig and the PreTrainedConfig fields
# its save_pretrained writes, plus the older names of both); any other field is refused (hf_config.check_fields).
READ_FIELDS = (  # reproduced: they set the ModelConfig
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "rms_norm_eps",
    "tie_word_embeddings",
    "router_aux_loss_coef",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "max_position_embeddings",
)
IRRELEVANT_FIELDS = (  # change nothing eqmoe computes from the weights: metadata, token ids, output switches
    *COMMON_IRRELEVANT_FIELDS,
    "sliding_window",  # read only with use_sliding_window (transformers sets it to None otherwise)
    "max_window_layers",  # likewise
)
FIXED_FIELDS = {  # eqmoe computes these only at the value shown (transformers' default)
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
    "attention_dropout": 0.0,
    "partial_rotary_factor": 1.0,
    "chunk_size_feed_forward": 0,
    "is_encoder_decoder": False,
}
FIELDS = FieldList(READ_FIELDS, IRRELEVANT_FIELDS, FIXED_FIELDS)
_HF_DEFAULT_MAX_POSITIONS = 32768  # Qwen3MoeConfig.max_position_embeddings


def check_fields(hf: dict[str, Any], source: str) -> None:
    """Refuse, naming the field and ``source``, any field outside the Qwen3-MoE allow-list and any fixed field
    whose value eqmoe does not compute (:func:`eqmoe.models.hf_config.check_fields`)."""
    hf_config.check_fields(hf, source, FIELDS)


def rope_from_hf(hf: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` as transformers' Qwen3-MoE reads them (:func:`hf_config.rope_from_hf`)."""
    return hf_config.rope_from_hf(hf, source, _HF_DEFAULT_MAX_POSITIONS)


def layer_kinds_from_hf(num_layers: int, num_experts: int, sparse_step: int, mlp_only: list[int]) -> list[str]:
    """HF Qwen3MoeDecoderLayer: layer ``i`` is MoE iff ``i not in mlp_only_layers and num_experts > 0 and
    (i + 1) % decoder_sparse_step == 0``; otherwise a dense SwiGLU of width ``intermediate_size``."""
    return [
        "moe" if i not in mlp_only and num_experts > 0 and (i + 1) % sparse_step == 0 else "dense"
        for i in range(num_layers)
    ]


def config_from_hf(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a :class:`ModelConfig` from a Hugging Face Qwen3-MoE ``config.json`` dictionary.

    Accepts ``num_experts`` or ``num_local_experts`` and ``rope_parameters`` or ``rope_scaling`` +
    ``rope_theta`` (:func:`rope_from_hf`); refuses every field outside the allow-list (:func:`check_fields`)
    and options eqmoe does not implement (sliding windows, attention biases, non-SiLU activations).
    """
    model_type = hf.get("model_type")
    if model_type != NAME:
        raise ValueError(f"{source}: model_type {model_type!r} is not supported; allowed: {NAME!r}")
    check_fields(hf, source)
    req = {
        name: require(hf, name, source)
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "moe_intermediate_size",
            "num_experts_per_tok",
        )
    }
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise ValueError(f"{source}: missing field 'num_experts' (or 'num_local_experts')")
    optional = {
        name: hf[name] for name in ("num_key_value_heads", "head_dim", "intermediate_size") if hf.get(name) is not None
    }
    integers = {**req, **optional, "num_experts": experts, "decoder_sparse_step": hf.get("decoder_sparse_step", 1)}
    if hf.get("max_position_embeddings") is not None:
        integers["max_position_embeddings"] = hf["max_position_embeddings"]
    positive_integers(integers, source)
    mlp_only = hf.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
        raise ValueError(f"{source}: mlp_only_layers={mlp_only!r} is invalid; allowed: a list of layer indices")
    kinds = layer_kinds_from_hf(req["num_hidden_layers"], experts, integers["decoder_sparse_step"], mlp_only)
    if "dense" in kinds:
        require(hf, "intermediate_size", source)
    theta, scaling = rope_from_hf(hf, source)
    try:
        return _qwen3_moe(
            vocab=req["vocab_size"],
            embed=req["hidden_size"],
            layers=req["num_hidden_layers"],
            heads=req["num_attention_heads"],
            kv_heads=optional.get("num_key_value_heads", req["num_attention_heads"]),
            head_dim=optional.get("head_dim", req["hidden_size"] // req["num_attention_heads"]),
            experts=experts,
            top_k=req["num_experts_per_tok"],
            expert_dim=req["moe_intermediate_size"],
            mlp_dim=optional.get("intermediate_size"),
            theta=theta,
            rope_scaling=scaling,
            kinds=kinds,
            tie=bool(hf.get("tie_word_embeddings", False)),
            renormalize=bool(hf.get("norm_topk_prob", False)),
            eps=float(hf.get("rms_norm_eps", 1e-6)),
            aux_coef=float(hf.get("router_aux_loss_coef", 0.001)),
        )
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: {error}") from None


# --- Checkpoint name map ---------------------------------------------------------------------------


def checkpoint_names(config: ModelConfig) -> list[TensorName]:
    """Every tensor of a Hugging Face Qwen3-MoE checkpoint for ``config``, in the Hub's key names."""
    names = outer_names(config)
    num_experts = config.moe.router.num_experts if config.moe else 0
    for layer, s, r, u, kind in layer_slots(config):
        block = ("segments", s, "blocks", u)
        prefix = f"model.layers.{layer}."
        names += attention_names(prefix, block, r, config.attention)
        if kind == "dense":
            names += swiglu_names(prefix + "mlp.", (*block, "ffn"), (r,))
            continue
        names.append(TensorName(prefix + "mlp.gate.weight", (*block, "ffn", "router", "weight"), (r,), 1))
        for j in range(num_experts):
            names += swiglu_names(prefix + f"mlp.experts.{j}.", (*block, "ffn", "experts"), (r, j))
    return names


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dictionary for ``config``; a ``ValueError`` names the first field
    that transformers' Qwen3-MoE cannot express."""
    moe = config.moe
    hf_config.check_expressible(config, "Qwen3-MoE", {"moe.router.renormalize": hf_config.ANY})
    if moe is None:
        raise ValueError("moe=None has no Hugging Face Qwen3-MoE equivalent; a MoEConfig is needed")
    kinds = config.layer_kinds()
    attention = config.attention
    max_positions = attention.rope_scaling.max_position_embeddings if attention.rope_scaling else None
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": config.vocab_size,
        "hidden_size": config.embed_dim,
        "intermediate_size": config.mlp_dim or moe.expert_dim,
        "moe_intermediate_size": moe.expert_dim,
        "num_hidden_layers": len(kinds),
        "num_attention_heads": attention.num_heads,
        "num_key_value_heads": attention.num_kv_heads,
        "head_dim": attention.head_dim,
        "num_experts": moe.router.num_experts,
        "num_experts_per_tok": moe.router.top_k,
        "norm_topk_prob": moe.router.renormalize,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, kind in enumerate(kinds) if kind == "dense"],
        "rms_norm_eps": config.norm.eps,
        "rope_parameters": rope_to_hf(attention.rope_theta, attention.rope_scaling),
        "tie_word_embeddings": config.tie_embeddings,
        "router_aux_loss_coef": config.loss.load_balance_weight,
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
        "max_position_embeddings": max_positions or _HF_DEFAULT_MAX_POSITIONS,
        "dtype": config.param_dtype,
    }


FAMILY = register(
    Family(
        name=NAME,
        presets=PRESETS,
        hf_model_type=NAME,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        checkpoint_names=checkpoint_names,
    )
)
