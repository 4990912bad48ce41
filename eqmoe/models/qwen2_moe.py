"""The Qwen2-MoE family (Hugging Face ``model_type`` ``"qwen2_moe"``: Qwen1.5-MoE and Qwen2-MoE): published
presets, the ``config.json`` reader and writer and the checkpoint name map.

Qwen2-MoE is Qwen3-MoE's decoder with biases on the query/key/value projections (``qkv_bias``) instead of
QK-norm, and a shared expert in every MoE block: a SwiGLU of width ``shared_expert_intermediate_size`` that
sees every token, multiplied by ``sigmoid(x @ shared_expert_gate)`` and added to the routed output (eqmoe's
``shared_experts=1`` with ``shared_expert_gate``). The router, the dense/MoE layer layout
(``decoder_sparse_step``, ``mlp_only_layers``) and the auxiliary loss (the pooled ``load_balancing_loss_func``,
eqmoe's ``hf_pooled``) are Qwen3-MoE's.
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
from eqmoe.models.family import Family, TensorName, layer_slots, register, swiglu_names
from eqmoe.models.field_map import Field, FieldMap, Fixed, Known, Rule, show
from eqmoe.models.hf_config import decoder_fields, full_attention_rule, rope_rule, sparse_layout_rule

NAME = "qwen2_moe"


def _qwen2_moe(
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
    shared_dim: int,
    mlp_dim: int | None,
    theta: float,
    rope_scaling: RopeScaling | None = None,
    kinds: list[str] | None = None,
    qkv_bias: bool = True,
    tie: bool = False,
    renormalize: bool = False,
    eps: float = 1e-6,
    aux_coef: float = 0.001,
) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        embed_dim=embed,
        attention=AttentionConfig(
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=theta,
            rope_scaling=rope_scaling,
            qk_norm="none",
            bias="qkv" if qkv_bias else "none",
        ),
        layers=tuple(kinds or ["moe"] * layers),
        # intermediate_size is kept even when every layer is MoE, so that an export writes it back unchanged.
        mlp_dim=mlp_dim,
        moe=MoEConfig(
            router=RouterConfig(num_experts=experts, top_k=top_k, strategy="softmax_top_k", renormalize=renormalize),
            expert_dim=expert_dim,
            shared_experts=1,
            shared_expert_dim=shared_dim,
            shared_expert_gate=True,
        ),
        norm=NormConfig(eps=eps, ffn_placement="pre"),
        loss=LossConfig(load_balance="hf_pooled", load_balance_weight=aux_coef),
        tie_embeddings=tie,
        family=NAME,
    )


PRESETS: dict[str, ModelConfig] = {
    # Qwen/Qwen1.5-MoE-A2.7B config.json (rope_theta 1e6, rms_norm_eps 1e-6, max_position_embeddings 8192,
    # use_sliding_window false, norm_topk_prob false; qkv_bias absent, so transformers' default true).
    "qwen1.5-moe-a2.7b": _qwen2_moe(
        vocab=151936,
        embed=2048,
        layers=24,
        heads=16,
        kv_heads=16,
        head_dim=128,
        experts=60,
        top_k=4,
        expert_dim=1408,
        shared_dim=5632,
        mlp_dim=5632,
        theta=1e6,
    ),
    # Qwen/Qwen2-57B-A14B config.json (rope_theta 1e6, rms_norm_eps 1e-6, use_sliding_window false,
    # norm_topk_prob false; qkv_bias absent, so true).
    "qwen2-57b-a14b": _qwen2_moe(
        vocab=151936,
        embed=3584,
        layers=28,
        heads=28,
        kv_heads=4,
        head_dim=128,
        experts=64,
        top_k=8,
        expert_dim=2560,
        shared_dim=20480,
        mlp_dim=18944,
        theta=1e6,
    ),
}


# --- Hugging Face config.json: transformers' Qwen2MoeConfig ----------------------------------------------


def _shared_read(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``shared_expert_intermediate_size``: one gated shared expert of that width. 0, which transformers builds as
    a shared expert that adds nothing, is refused: eqmoe's shared experts have a positive width, and without them
    the checkpoint's ``shared_expert_gate`` would have nowhere to go."""
    if "shared_expert_intermediate_size" not in hf:
        raise ValueError(f"{source}: missing field 'shared_expert_intermediate_size'")
    width = hf["shared_expert_intermediate_size"]
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(
            f"{source}: shared_expert_intermediate_size={show(width)} is not supported (eqmoe's shared expert has a "
            "positive width); allowed: a positive integer"
        )
    return {"moe.shared_experts": 1, "moe.shared_expert_dim": width}


def _shared_write(config: ModelConfig) -> dict[str, Any]:
    if config.moe is None or config.moe.shared_experts < 1:  # transformers' block always has a gated shared expert
        raise ValueError(
            "moe.shared_experts=0 has no Hugging Face Qwen2-MoE equivalent; allowed: >= 1 (with shared_expert_gate)"
        )
    # Several shared experts are one SwiGLU of their summed width, which is what transformers builds.
    return {"shared_expert_intermediate_size": config.moe.shared_width}


def _qkv_bias_write(bias: str) -> bool:
    if bias not in ("none", "qkv"):
        raise ValueError("allowed: 'none' | 'qkv' (qkv_bias; o_proj has none)")
    return bias == "qkv"


FIELD_MAP = FieldMap(
    model_type=NAME,
    architecture="Qwen2MoeForCausalLM",
    label="Qwen2-MoE",
    template=PRESETS["qwen1.5-moe-a2.7b"],
    entries=(
        # num_key_value_heads defaults to 16, not to the head count; head_dim is written only when it is not derived
        *decoder_fields(kv_default=16, eps=1e-6, head_dim=False),
        # kept even when every layer is MoE, so that an export writes it back unchanged
        Field("intermediate_size", "mlp_dim", None, kind="positive"),
        Field("moe_intermediate_size", "moe.expert_dim", kind="positive"),
        Rule(
            ("shared_expert_intermediate_size",),
            ("moe.shared_experts", "moe.shared_expert_dim"),
            _shared_read,
            _shared_write,
        ),
        Field("num_experts", "moe.router.num_experts", 60, kind="positive"),
        Field("num_experts_per_tok", "moe.router.top_k", 4, kind="positive"),
        Field("norm_topk_prob", "moe.router.renormalize", False, kind="bool"),
        Field(
            "qkv_bias",
            "attention.bias",
            True,
            kind="bool",
            read=lambda on: "qkv" if on else "none",
            write=_qkv_bias_write,
        ),
        Field("router_aux_loss_coef", "loss.load_balance_weight", 0.001, kind="number", read=float),
        sparse_layout_rule(lambda hf: hf.get("num_experts", 60), "Qwen2-MoE"),
        full_attention_rule(),
        rope_rule(32768, "Qwen2-MoE"),
        Fixed("hidden_act", "silu"),
        Fixed("use_sliding_window", False),
        Fixed("attention_dropout", 0.0),
        Known(("sliding_window", "max_window_layers")),  # read only with use_sliding_window
    ),
)


def config_from_hf(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face Qwen2-MoE ``config.json`` dictionary (:data:`FIELD_MAP`)."""
    return FIELD_MAP.read(hf, source)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dictionary for ``config``; a ``ValueError`` names the first field
    that transformers' Qwen2-MoE cannot express (:data:`FIELD_MAP`)."""
    return FIELD_MAP.write(config)


# --- Checkpoint name map ---------------------------------------------------------------------------


def checkpoint_names(config: ModelConfig) -> list[TensorName]:
    """Every tensor of a Hugging Face Qwen2-MoE checkpoint for ``config``, in the Hub's key names (those
    transformers' ``save_pretrained`` writes): Qwen3-MoE's (:func:`eqmoe.models.qwen3_moe.checkpoint_names`:
    norms, projections and their biases, dense MLPs, router gate and per-expert ``gate/up/down_proj``) plus each
    MoE layer's ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate``."""
    names = qwen3_moe.checkpoint_names(config)
    for layer, s, r, u, kind in layer_slots(config):
        if kind.ffn == "moe":
            block, prefix = ("segments", s, "blocks", u, "ffn"), f"model.layers.{layer}.mlp."
            names += swiglu_names(prefix + "shared_expert.", (*block, "shared_expert"), (r,))
            names.append(TensorName(prefix + "shared_expert_gate.weight", (*block, "shared_gate", "weight"), (r,), 1))
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
