"""The OLMoE family (Hugging Face ``model_type`` ``"olmoe"``): published presets, the ``config.json`` reader and
writer and the checkpoint name map.

OLMoE is Mixtral's MoE decoder with three attention differences: ``q_norm`` and ``k_norm`` are RMSNorms over the
*whole* query and key projections (``[heads * head_dim]``, ``[kv_heads * head_dim]``), applied before the split into
heads and before RoPE (eqmoe's ``qk_norm_scope="projection"``); ``attention_bias`` puts biases on q, k, v *and* o
(``bias="qkvo"``); and ``clip_qkv`` clamps q, k and v after the norms. Every layer is MoE, the router takes a
float32 softmax over all experts and keeps the top-k, renormalised only with ``norm_topk_prob`` (false in
OLMoE-1B-7B), and the auxiliary loss is transformers' pooled ``load_balancing_loss_func`` (eqmoe's ``hf_pooled``).

The norms' sizes come from ``hidden_size`` (``q_norm``: ``hidden_size``, ``k_norm``:
``hidden_size // heads * kv_heads``), so transformers runs only when ``head_dim == hidden_size // heads`` and
``hidden_size`` is a multiple of the head count; other shapes are refused here rather than exported unloadable.
"""

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
from eqmoe.models import hf_config, qwen3_moe
from eqmoe.models.family import Family, register
from eqmoe.models.hf_config import COMMON_IRRELEVANT_FIELDS, FieldList, positive_integers, require, rope_to_hf, show

NAME = "olmoe"


def _olmoe(
    *,
    vocab: int,
    embed: int,
    layers: int,
    heads: int,
    kv_heads: int,
    experts: int,
    top_k: int,
    expert_dim: int,
    theta: float,
    rope_scaling: RopeScaling | None = None,
    tie: bool = False,
    renormalize: bool = False,
    bias: bool = False,
    clip_qkv: float | None = None,
    eps: float = 1e-5,
    aux_coef: float = 0.01,
) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        embed_dim=embed,
        attention=AttentionConfig(
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=embed // heads,  # OlmoeAttention's q_norm spans hidden_size: no other head_dim runs
            rope_theta=theta,
            rope_scaling=rope_scaling,
            qk_norm="before_rope",
            qk_norm_scope="projection",
            bias="qkvo" if bias else "none",
            clip_qkv=clip_qkv,
        ),
        layers=segments_from_kinds(["moe"] * layers),
        moe=MoEConfig(
            router=RouterConfig(num_experts=experts, top_k=top_k, strategy="softmax_top_k", renormalize=renormalize),
            expert_dim=expert_dim,
        ),
        norm=NormConfig(eps=eps, ffn_placement="pre"),
        loss=LossConfig(load_balance="hf_pooled", load_balance_weight=aux_coef),
        tie_embeddings=tie,
        family=NAME,
    )


PRESETS: dict[str, ModelConfig] = {
    # allenai/OLMoE-1B-7B-0924 config.json (rope_theta 1e4, rms_norm_eps 1e-5, norm_topk_prob false,
    # clip_qkv null, attention_bias false, router_aux_loss_coef 0.01): 6.92B parameters, 1.3B active.
    "olmoe-1b-7b": _olmoe(
        vocab=50304,
        embed=2048,
        layers=16,
        heads=16,
        kv_heads=16,
        experts=64,
        top_k=8,
        expert_dim=1024,
        theta=1e4,
    ),
}


# --- Hugging Face config.json -------------------------------------------------------------------

# Every field an OLMoE config.json may hold (transformers' OlmoeConfig, the PreTrainedConfig fields its
# save_pretrained writes, and the older top-level rope_theta / rope_scaling); any other field is refused.
# OlmoeConfig has no z-loss or jitter field: only router_aux_loss_coef enters its loss.
READ_FIELDS = (  # reproduced: they set the ModelConfig
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",  # not an OlmoeConfig field, but OlmoeAttention reads it when present: must be hidden // heads
    "num_experts",
    "num_local_experts",  # OlmoeConfig.attribute_map alias of num_experts
    "num_experts_per_tok",
    "norm_topk_prob",
    "attention_bias",
    "clip_qkv",
    "rms_norm_eps",
    "tie_word_embeddings",
    "router_aux_loss_coef",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "max_position_embeddings",
)
FIXED_FIELDS = {  # eqmoe computes these only at the value shown (transformers' default)
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "chunk_size_feed_forward": 0,
    "is_encoder_decoder": False,
}
FIELDS = FieldList(READ_FIELDS, COMMON_IRRELEVANT_FIELDS, FIXED_FIELDS)
# OlmoeConfig's defaults, which transformers uses when config.json leaves a field out.
_HF_DEFAULTS = {
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "rms_norm_eps": 1e-5,
    "router_aux_loss_coef": 0.01,
    "max_position_embeddings": 4096,
}


def check_fields(hf: dict[str, Any], source: str) -> None:
    """Refuse, naming the field and ``source``, any field outside the OLMoE allow-list and any fixed field whose
    value eqmoe does not compute (:func:`eqmoe.models.hf_config.check_fields`)."""
    hf_config.check_fields(hf, source, FIELDS)


def _clip_qkv(hf: dict[str, Any], source: str) -> float | None:
    """``clip_qkv``: null (no clamp) or a positive number (transformers clamps to ``[-c, c]``; a zero or negative
    ``c`` would zero or invert q, k and v, never meant)."""
    value = hf.get("clip_qkv")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{source}: clip_qkv={show(value)} is invalid; allowed: null or a positive number")
    return float(value)


def config_from_hf(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a :class:`ModelConfig` from a Hugging Face OLMoE ``config.json`` dictionary.

    Fields left out take OlmoeConfig's defaults, as transformers reads them (``num_key_value_heads`` =
    ``num_attention_heads``, 64 experts, top-8); the widths and depth are required so that a truncated file is
    not read as OLMoE-1B-7B. A ``head_dim`` other than ``hidden_size // num_attention_heads``, or a
    ``hidden_size`` the heads do not divide, is refused: transformers' ``q_norm`` (size ``hidden_size``) would not
    fit the query projection (``heads * head_dim``).
    """
    model_type = hf.get("model_type")
    if model_type != NAME:
        raise ValueError(f"{source}: model_type {model_type!r} is not supported; allowed: {NAME!r}")
    check_fields(hf, source)
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    integers = {name: require(hf, name, source) for name in sizes}
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    integers["num_experts"] = experts if experts is not None else _HF_DEFAULTS["num_experts"]
    integers["num_key_value_heads"] = hf.get("num_key_value_heads") or integers["num_attention_heads"]
    for name in ("num_experts_per_tok", "max_position_embeddings"):
        integers[name] = hf[name] if hf.get(name) is not None else _HF_DEFAULTS[name]
    positive_integers(integers, source)
    hidden, heads = integers["hidden_size"], integers["num_attention_heads"]
    if hidden % heads:
        raise ValueError(
            f"{source}: num_attention_heads={heads} is not supported: OLMoE's q_norm spans hidden_size={hidden}, "
            "so the heads must divide it"
        )
    if hf.get("head_dim") is not None and hf["head_dim"] != hidden // heads:
        raise ValueError(
            f"{source}: head_dim={show(hf['head_dim'])} is not supported; allowed: "
            f"hidden_size // num_attention_heads = {hidden // heads} (OLMoE's q_norm spans hidden_size)"
        )
    theta, scaling = hf_config.rope_from_hf(hf, source, _HF_DEFAULTS["max_position_embeddings"])
    clip_qkv = _clip_qkv(hf, source)
    try:
        return _olmoe(
            vocab=integers["vocab_size"],
            embed=hidden,
            layers=integers["num_hidden_layers"],
            heads=heads,
            kv_heads=integers["num_key_value_heads"],
            experts=integers["num_experts"],
            top_k=integers["num_experts_per_tok"],
            expert_dim=integers["intermediate_size"],
            theta=theta,
            rope_scaling=scaling,
            tie=bool(hf.get("tie_word_embeddings", False)),
            renormalize=bool(hf.get("norm_topk_prob", False)),
            bias=bool(hf.get("attention_bias", False)),
            clip_qkv=clip_qkv,
            eps=float(hf.get("rms_norm_eps", _HF_DEFAULTS["rms_norm_eps"])),
            aux_coef=float(hf.get("router_aux_loss_coef", _HF_DEFAULTS["router_aux_loss_coef"])),
        )
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: {error}") from None


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dictionary for ``config``; a ``ValueError`` names the first field
    that transformers' OLMoE cannot express."""
    moe = config.moe
    router = moe.router if moe else None
    attention = config.attention
    heads = attention.num_heads
    if set(config.layer_kinds()) != {"moe"}:
        raise ValueError("layers='dense layers' has no Hugging Face OLMoE equivalent; allowed: 'moe'")
    expressible = {
        "attention.qk_norm_scope": ("projection",),
        "attention.bias": ("none", "qkvo"),  # attention_bias is one switch for q, k, v and o
        "attention.clip_qkv": hf_config.ANY,
        "moe.router.renormalize": hf_config.ANY,
    }
    hf_config.check_expressible(config, "OLMoE", expressible)
    if heads * attention.head_dim != config.embed_dim:  # q_norm has hidden_size weights
        raise ValueError(
            f"attention.head_dim={attention.head_dim} has no Hugging Face OLMoE equivalent; allowed: "
            f"embed_dim / num_heads = {config.embed_dim / heads:g} (OLMoE's q_norm spans hidden_size)"
        )
    max_positions = attention.rope_scaling.max_position_embeddings if attention.rope_scaling else None
    # No head_dim: OlmoeConfig has none (it derives hidden_size // num_attention_heads, checked above).
    return {
        "architectures": ["OlmoeForCausalLM"],
        "model_type": NAME,
        "vocab_size": config.vocab_size,
        "hidden_size": config.embed_dim,
        "intermediate_size": moe.expert_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": attention.num_kv_heads,
        "num_experts": router.num_experts,
        "num_experts_per_tok": router.top_k,
        "norm_topk_prob": router.renormalize,
        "attention_bias": attention.bias == "qkvo",
        "clip_qkv": attention.clip_qkv,
        "rms_norm_eps": config.norm.eps,
        "rope_parameters": rope_to_hf(attention.rope_theta, attention.rope_scaling),
        "tie_word_embeddings": config.tie_embeddings,
        "router_aux_loss_coef": config.loss.load_balance_weight,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "max_position_embeddings": max_positions or _HF_DEFAULTS["max_position_embeddings"],
        "dtype": config.param_dtype,
    }


# --- Checkpoint name map ---------------------------------------------------------------------------


FAMILY = register(
    Family(
        name=NAME,
        presets=PRESETS,
        hf_model_type=NAME,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        # Qwen3-MoE's names (transformers converts both with its qwen2_moe mapping, and the Hub stores
        # per-expert gate/up/down_proj); q_norm/k_norm name the same leaves, here of projection size.
        checkpoint_names=qwen3_moe.checkpoint_names,
    )
)
