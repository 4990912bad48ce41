"""The DeepSeek-V3 family (Hugging Face ``model_type`` ``"deepseek_v3"``; Kimi K2's ``"kimi_k2"`` files name the same
``DeepseekV3ForCausalLM``): DeepSeek-V3 / V3.1 / R1, Kimi K2 and Moonlight.

What the generic decoder takes from it:

- attention: multi-head latent attention (the ``mla`` kind, :mod:`eqmoe.nn.mla`) in every layer, its widths in
  ``AttentionConfig.latent``; RoPE on pairs (``rope_interleave``) over the ``qk_rope_head_dim`` slice, YaRN's
  ``mscale_all_dim`` folded into the softmax scale;
- router: ``sigmoid(float32 logits)``, chosen by ``score + e_score_correction_bias`` among the ``topk_group`` best of
  ``n_group`` groups (a group scores its two best), weighted by the score (divided by the sum when
  ``norm_topk_prob``) times ``routed_scaling_factor``: ``sigmoid_top_k`` with group limiting and the aux-loss-free
  selection bias, into which ``e_score_correction_bias`` loads;
- FFN: the first ``first_k_dense_replace`` layers dense, the rest routed experts plus ``n_shared_experts`` ungated
  shared ones of width ``moe_intermediate_size``; no auxiliary loss (transformers' causal LM trains none).

The published folders also hold ``num_nextn_predict_layers`` multi-token-prediction layers after the last decoder
layer (``model.layers.61.*`` for DeepSeek-V3), which transformers' causal LM skips; eqmoe loads them into the model's
``mtp`` part, keeps them through training and exports them back (:func:`mtp_names`).
"""

from collections.abc import Mapping
from typing import Any

from eqmoe.config import (
    AttentionConfig,
    LatentAttentionConfig,
    LayerKind,
    LossConfig,
    ModelConfig,
    MoEConfig,
    NormConfig,
    RopeScaling,
    RouterConfig,
)
from eqmoe.models import glm4_moe
from eqmoe.models.family import Family, TensorName, register
from eqmoe.models.field_map import Field, FieldMap, Fixed, Known, Rule, show
from eqmoe.models.hf_config import (
    decoder_fields,
    dense_first_rule,
    expert_widths_rule,
    on_off,
    positive_shared,
    rope_rule,
    selection_bias_rule,
)
from eqmoe.models.mtp import mtp_names

NAME = "deepseek_v3"
LABEL = "DeepSeek-V3"

# How fast eqmoe moves the selection bias when it trains a DeepSeek-V3 model: the paper's gamma = 0.001.
# transformers keeps e_score_correction_bias a buffer nothing updates; the rate is not written to config.json.
BIAS_UPDATE_RATE = 0.001


def deepseek(
    *,
    family: str,
    vocab: int,
    embed: int,
    layers: int,
    dense_layers: int,
    heads: int,
    q_rank: int | None,
    kv_rank: int,
    nope: int,
    rope: int,
    value: int,
    experts: int,
    top_k: int,
    expert_dim: int,
    mlp_dim: int,
    shared_experts: int,
    scaling_factor: float,
    groups: int,
    groups_kept: int,
    theta: float,
    rope_scaling: RopeScaling | None,
    renormalize: bool = True,
    strategy: str = "sigmoid_top_k",
    group_score: str = "top2_sum",
    bias_update_rate: float = BIAS_UPDATE_RATE,
    eps: float = 1e-6,
    mtp_layers: int = 0,
) -> ModelConfig:
    """A DeepSeek-V2/V3-style config from its ``config.json`` numbers (shared by :mod:`eqmoe.models.deepseek_v2`)."""
    return ModelConfig(
        vocab_size=vocab,
        embed_dim=embed,
        attention=AttentionConfig(
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=nope + rope,
            rope_theta=theta,
            rope_scaling=rope_scaling,
            rope_layout="interleaved",
            qk_norm="none",
            latent=LatentAttentionConfig(kv_rank=kv_rank, rope_dim=rope, value_dim=value, q_rank=q_rank),
        ),
        layers=tuple(LayerKind("mla", "dense" if i < dense_layers else "moe") for i in range(layers)),
        mlp_dim=mlp_dim,
        moe=MoEConfig(
            router=RouterConfig(
                num_experts=experts,
                top_k=top_k,
                strategy=strategy,
                renormalize=renormalize,
                routed_scaling_factor=scaling_factor,
                expert_groups=groups,
                expert_groups_kept=groups_kept,
                expert_group_score=group_score,
                bias_update_rate=bias_update_rate,
            ),
            expert_dim=expert_dim,
            shared_experts=shared_experts,
            shared_expert_dim=expert_dim,
        ),
        norm=NormConfig(eps=eps, ffn_placement="pre"),
        loss=LossConfig(load_balance_weight=0.0),  # transformers' DeepSeek causal LMs train no auxiliary loss
        mtp_layers=mtp_layers,
        family=family,
    )


def _yarn(factor: float, original: int, max_positions: int, mscale: float, beta_fast: float) -> RopeScaling:
    return RopeScaling(
        "yarn",
        factor,
        original_max_position_embeddings=original,
        max_position_embeddings=max_positions,
        beta_fast=beta_fast,
        beta_slow=1.0,
        mscale=mscale,
        mscale_all_dim=mscale,
    )


_V3 = dict(  # deepseek-ai/DeepSeek-V3 config.json (V3.1 and R1 are the same shape)
    vocab=129280,
    embed=7168,
    layers=61,
    dense_layers=3,
    heads=128,
    q_rank=1536,
    kv_rank=512,
    nope=128,
    rope=64,
    value=128,
    experts=256,
    top_k=8,
    expert_dim=2048,
    mlp_dim=18432,
    shared_experts=1,
    scaling_factor=2.5,
    groups=8,
    groups_kept=4,
    theta=10000.0,
    rope_scaling=_yarn(40.0, 4096, 163840, 1.0, 32.0),
    mtp_layers=1,
)

PRESETS: dict[str, ModelConfig] = {
    "deepseek-v3": deepseek(family=NAME, **_V3),
    # CPU-sized, every part of DeepSeek-V3 present: query latent, YaRN, 8 experts in 4 groups (2 kept), a shared
    # expert, a dense first layer and one multi-token-prediction layer
    "deepseek-v3-micro": deepseek(
        family=NAME,
        vocab=512,
        embed=64,
        layers=4,
        dense_layers=1,
        heads=4,
        q_rank=48,
        kv_rank=32,
        nope=16,
        rope=8,
        value=16,
        experts=8,
        top_k=2,
        expert_dim=64,
        mlp_dim=128,
        shared_experts=1,
        scaling_factor=2.5,
        groups=4,
        groups_kept=2,
        theta=10000.0,
        rope_scaling=_yarn(4.0, 256, 1024, 1.0, 32.0),
        mtp_layers=1,
    ),
    # moonshotai/Kimi-K2-Instruct config.json ("model_type": "kimi_k2"): 384 experts, 64 heads, one dense layer
    "kimi-k2": deepseek(
        family=NAME,
        **{
            **_V3,
            "vocab": 163840,
            "heads": 64,
            "experts": 384,
            "dense_layers": 1,
            "scaling_factor": 2.827,
            "groups": 1,
            "groups_kept": 1,
            "theta": 50000.0,
            "rope_scaling": _yarn(32.0, 4096, 131072, 1.0, 1.0),
            "mtp_layers": 0,
        },
    ),
    # moonshotai/Moonlight-16B-A3B config.json: no query latent, 64 experts top-6, two shared, no RoPE scaling
    "moonlight-16b-a3b": deepseek(
        family=NAME,
        vocab=163840,
        embed=2048,
        layers=27,
        dense_layers=1,
        heads=16,
        q_rank=None,
        kv_rank=512,
        nope=128,
        rope=64,
        value=128,
        experts=64,
        top_k=6,
        expert_dim=1408,
        mlp_dim=11264,
        shared_experts=2,
        scaling_factor=2.446,
        groups=1,
        groups_kept=1,
        theta=50000.0,
        rope_scaling=None,
        eps=1e-5,
    ),
}


# --- Hugging Face config.json: transformers' DeepseekV3Config ----------------------------------------------


def _count(hf: Mapping[str, Any], key: str, default: Any, source: str, nullable: bool = False) -> int | None:
    value = hf.get(key, default)
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "null | a positive integer" if nullable else "a positive integer"
        raise ValueError(f"{source}: {key}={show(value)} is invalid; allowed: {allowed}")
    return value


def latent_rule(label: str) -> Rule:
    """``q_lora_rank`` (null: one ``q_proj``), ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
    ``v_head_dim`` <-> ``attention.latent`` and ``attention.head_dim`` (nope + rope), with DeepseekV3Config's
    defaults (DeepseekV2Config's are the same)."""

    def read(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        nope = _count(hf, "qk_nope_head_dim", 128, source)
        rope = _count(hf, "qk_rope_head_dim", 64, source)
        if rope % 2:
            raise ValueError(f"{source}: qk_rope_head_dim={rope} is invalid; allowed: an even number")
        latent = dict(
            q_rank=_count(hf, "q_lora_rank", 1536, source, nullable=True),
            kv_rank=_count(hf, "kv_lora_rank", 512, source),
            rope_dim=rope,
            value_dim=_count(hf, "v_head_dim", 128, source),
            norm_eps=1e-6,
        )
        return {"attention.head_dim": nope + rope, "attention.latent": latent}

    def write(config: ModelConfig) -> dict[str, Any]:
        latent = config.attention.latent
        if latent is None or latent.norm_eps != 1e-6:
            value = None if latent is None else latent.norm_eps
            raise ValueError(
                f"attention.latent{'' if latent is None else '.norm_eps'}={value!r} has no Hugging Face {label} "
                "equivalent; allowed: a LatentAttentionConfig with norm_eps 1e-6"
            )
        return {
            "q_lora_rank": latent.q_rank,
            "kv_lora_rank": latent.kv_rank,
            "qk_nope_head_dim": config.attention.head_dim - latent.rope_dim,
            "qk_rope_head_dim": latent.rope_dim,
            "v_head_dim": latent.value_dim,
        }

    keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    return Rule(keys, ("attention.head_dim", "attention.latent"), read, write)


def mla_fields(label: str, max_positions: int) -> tuple:
    """The attention part of a DeepSeek ``config.json``: widths, latent ranks, RoPE, ``attention_bias``."""
    return (
        *(field for field in decoder_fields(eps=1e-6) if field.key != "head_dim"),
        # transformers sets head_dim to qk_rope_head_dim and qk_head_dim to nope + rope itself, whatever the file says
        Known(("head_dim", "qk_head_dim")),
        latent_rule(label),
        Field(
            "attention_bias",
            "attention.bias",
            False,
            kind="bool",
            read=lambda on: "qkvo" if on else "none",
            write=on_off("qkvo", "none", "attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj"),
        ),
        rope_rule(max_positions, label),
        Field("intermediate_size", "mlp_dim", kind="positive"),
        expert_widths_rule(label),
        Field("n_shared_experts", "moe.shared_experts", 1, kind="positive", write=positive_shared),
        Fixed("hidden_act", "silu"),
        Fixed("attention_dropout", 0.0),
        Known(("pretraining_tp",)),  # transformers' DeepSeek models never read it
    )


def mtp_rule() -> Rule:
    """``num_nextn_predict_layers`` (alias ``num_mtp_layers``) <-> ``mtp_layers``: the multi-token-prediction layers
    the folder holds (``hf.load`` reads fewer when their tensors are absent, keeping the declared count in
    ``mtp_layers_declared`` for the export)."""

    def read(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        key = "num_nextn_predict_layers" if "num_nextn_predict_layers" in hf else "num_mtp_layers"
        value = hf.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{source}: {key}={show(value)} is invalid; allowed: an integer >= 0")
        return {"mtp_layers": value}

    def write(config: ModelConfig) -> dict[str, Any]:
        declared = config.mtp_layers_declared
        return {"num_nextn_predict_layers": config.mtp_layers if declared is None else declared}

    return Rule(("num_nextn_predict_layers", "num_mtp_layers"), ("mtp_layers",), read, write)


FIELD_MAP = FieldMap(
    model_type=NAME,
    architecture="DeepseekV3ForCausalLM",
    label=LABEL,
    template=PRESETS["deepseek-v3"],
    also_reads=("kimi_k2",),
    entries=(
        *mla_fields(LABEL, 4096),
        Field(
            "rope_interleave",
            "attention.rope_layout",
            True,
            kind="bool",
            read=lambda on: "interleaved" if on else "half_split",
            write=on_off("interleaved", "half_split", "rope_interleave"),
        ),
        Field("n_routed_experts", "moe.router.num_experts", 256, kind="positive", aliases=("num_local_experts",)),
        Field("num_experts_per_tok", "moe.router.top_k", 8, kind="positive"),
        Field("routed_scaling_factor", "moe.router.routed_scaling_factor", 2.5, kind="positive_number", read=float),
        Field("n_group", "moe.router.expert_groups", 8, kind="positive"),
        Field("topk_group", "moe.router.expert_groups_kept", 4, kind="positive"),
        Field("norm_topk_prob", "moe.router.renormalize", True, kind="bool"),
        dense_first_rule(LABEL, 3, attention="mla"),
        selection_bias_rule(LABEL),
        mtp_rule(),
    ),
)


def checkpoint_names(config: ModelConfig) -> list[TensorName]:
    """Every tensor of a Hugging Face DeepSeek-V3 checkpoint for ``config``, in the Hub's key names: GLM-4.5's layout
    (which is DeepSeek's: router ``gate`` with ``e_score_correction_bias``, per-expert ``gate/up/down_proj``,
    ``shared_experts``) with latent attention's projections, then the multi-token-prediction layers."""
    return glm4_moe.checkpoint_names(config) + mtp_names(config)


FAMILY = register(
    Family(
        name=NAME,
        presets=PRESETS,
        hf_model_type=NAME,
        field_map=FIELD_MAP,
        checkpoint_names=checkpoint_names,
    )
)
