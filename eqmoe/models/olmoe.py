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

from collections.abc import Mapping
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
from eqmoe.models import qwen3_moe
from eqmoe.models.family import Family, register
from eqmoe.models.field_map import Field, FieldMap, Fixed, Rule, show
from eqmoe.models.hf_config import all_moe_rule, decoder_fields, rope_rule

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
        layers=("moe",) * layers,
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


# --- Hugging Face config.json: transformers' OlmoeConfig ---------------------------------------------------


def _head_dim_read(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``head_dim`` is ``hidden_size // num_attention_heads``: OLMoE's ``q_norm`` spans ``hidden_size``, so
    transformers runs only when the heads divide it and a file's ``head_dim`` (which OlmoeAttention reads when
    present) is that quotient."""
    hidden, heads = hf.get("hidden_size"), hf.get("num_attention_heads")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hidden, heads)):
        return {}  # the width fields name the problem
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
    return {"attention.head_dim": hidden // heads}


def _head_dim_write(config: ModelConfig) -> dict[str, Any]:
    heads, head_dim = config.attention.num_heads, config.attention.head_dim
    if heads * head_dim != config.embed_dim:  # q_norm has hidden_size weights; OlmoeConfig has no head_dim
        raise ValueError(
            f"attention.head_dim={head_dim} has no Hugging Face OLMoE equivalent; allowed: "
            f"embed_dim / num_heads = {config.embed_dim / heads:g} (OLMoE's q_norm spans hidden_size)"
        )
    return {}


def _bias_write(bias: str) -> bool:
    if bias not in ("none", "qkvo"):
        raise ValueError("allowed: 'none' | 'qkvo' (attention_bias is one switch for q, k, v and o)")
    return bias == "qkvo"


FIELD_MAP = FieldMap(
    model_type=NAME,
    architecture="OlmoeForCausalLM",
    label="OLMoE",
    template=PRESETS["olmoe-1b-7b"],
    entries=(
        *(field for field in decoder_fields(eps=1e-5) if field.key != "head_dim"),
        Rule(("head_dim",), ("attention.head_dim",), _head_dim_read, _head_dim_write),
        Field("intermediate_size", "moe.expert_dim", kind="positive"),
        Field("num_experts", "moe.router.num_experts", 64, kind="positive", aliases=("num_local_experts",)),
        Field("num_experts_per_tok", "moe.router.top_k", 8, kind="positive"),
        Field("norm_topk_prob", "moe.router.renormalize", False, kind="bool"),
        Field(
            "attention_bias",
            "attention.bias",
            False,
            kind="bool",
            read=lambda on: "qkvo" if on else "none",
            write=_bias_write,
        ),
        Field("clip_qkv", "attention.clip_qkv", None, kind="positive_number", read=float, nullable=True),
        Field("router_aux_loss_coef", "loss.load_balance_weight", 0.01, kind="number", read=float),
        all_moe_rule("OLMoE"),
        rope_rule(4096, "OLMoE"),
        Fixed("hidden_act", "silu"),
        Fixed("attention_dropout", 0.0),
    ),
)


def config_from_hf(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face OLMoE ``config.json`` dictionary (:data:`FIELD_MAP`)."""
    return FIELD_MAP.read(hf, source)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dictionary for ``config``; a ``ValueError`` names the first field
    that transformers' OLMoE cannot express (:data:`FIELD_MAP`)."""
    return FIELD_MAP.write(config)


# --- Checkpoint name map ---------------------------------------------------------------------------


FAMILY = register(
    Family(
        name=NAME,
        presets=PRESETS,
        hf_model_type=NAME,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        field_map=FIELD_MAP,
        # Qwen3-MoE's names (transformers converts both with its qwen2_moe mapping, and the Hub stores
        # per-expert gate/up/down_proj); q_norm/k_norm name the same leaves, here of projection size.
        checkpoint_names=qwen3_moe.checkpoint_names,
    )
)
