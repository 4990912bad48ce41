"""The GLM-4.5 MoE family (Hugging Face ``model_type`` ``"glm4_moe"``): published presets, the ``config.json``
reader and writer and the checkpoint name map.

GLM-4.5 is Qwen3-MoE's decoder with DeepSeek-V3's routing and a few attention options:

- attention: q/k/v projections with biases when ``attention_bias`` (the output projection never has one),
  per-head QK-norm before RoPE only when ``use_qk_norm``, and partial RoPE: only the first
  ``int(head_dim * partial_rotary_factor)`` dimensions of each head rotate (``partial_rotary_factor`` defaults
  to 0.5, not 1.0);
- router: ``s = sigmoid(float32 logits)``, experts chosen by ``s + e_score_correction_bias`` among the
  ``topk_group`` best of ``n_group`` expert groups, weighted by the uncorrected ``s`` (divided by their sum
  when ``norm_topk_prob``) times ``routed_scaling_factor``: eqmoe's ``sigmoid_top_k`` with group limiting and
  the aux-loss-free selection bias, into which ``e_score_correction_bias`` loads;
- FFN: the first ``first_k_dense_replace`` layers are dense SwiGLUs; the MoE layers add ``n_shared_experts``
  ungated shared SwiGLU experts of width ``moe_intermediate_size`` to the routed output;
- no auxiliary loss: transformers' ``Glm4MoeForCausalLM`` returns the cross-entropy alone.

The Hub's checkpoints also hold the multi-token-prediction layers (``num_nextn_predict_layers``) after the
last decoder layer; transformers ignores them on load, and so does eqmoe (:data:`SKIPPED_KEYS`).
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
)
from eqmoe.models import qwen3_moe
from eqmoe.models.family import Family, TensorName, layer_slots, register, swiglu_names
from eqmoe.models.field_map import Field, FieldMap, Fixed, Known
from eqmoe.models.hf_config import (
    decoder_fields,
    dense_first_rule,
    expert_widths_rule,
    layer_kinds_from_hf,
    on_off,
    positive_shared,
    rope_rule,
    selection_bias_rule,
)

NAME = "glm4_moe"

# The selection bias's update speed when eqmoe trains a GLM model. transformers keeps e_score_correction_bias
# a float32 buffer that nothing updates; eqmoe moves it after every step by rate * sign(mean load - load),
# DeepSeek-V3's aux-loss-free rule, at DeepSeek-V3's bias update speed (gamma = 0.001). The rate is how
# training continues, not part of what the checkpoint computes, so it is not written to config.json.
BIAS_UPDATE_RATE = 0.001


def _glm4_moe(
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
    dense_layers: int,
    shared_experts: int,
    theta: float,
    rotary_dim: int | None,
    attention_bias: bool,
    qk_norm: bool,
    scaling_factor: float = 1.0,
    groups: int = 1,
    groups_kept: int = 1,
    renormalize: bool = True,
    rope_scaling: RopeScaling | None = None,
    tie: bool = False,
    eps: float = 1e-5,
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
            rotary_dim=rotary_dim,
            qk_norm="before_rope" if qk_norm else "none",
            bias="qkv" if attention_bias else "none",
        ),
        # HF Glm4MoeDecoderLayer: layer i is dense iff i < first_k_dense_replace (Qwen3's rule with those
        # layers as mlp_only_layers).
        layers=tuple(layer_kinds_from_hf(layers, experts, 1, list(range(dense_layers)))),
        mlp_dim=mlp_dim,
        moe=MoEConfig(
            router=RouterConfig(
                num_experts=experts,
                top_k=top_k,
                strategy="sigmoid_top_k",
                renormalize=renormalize,
                routed_scaling_factor=scaling_factor,
                expert_groups=groups,
                expert_groups_kept=groups_kept,
                bias_update_rate=BIAS_UPDATE_RATE,  # creates router.bias, where e_score_correction_bias loads
            ),
            expert_dim=expert_dim,
            shared_experts=shared_experts,
            shared_expert_dim=expert_dim,
            shared_expert_gate=False,
        ),
        norm=NormConfig(eps=eps, ffn_placement="pre"),
        loss=LossConfig(load_balance_weight=0.0),  # transformers' GLM trains no auxiliary loss
        tie_embeddings=tie,
        family=NAME,
    )


_AIR = dict(  # zai-org/GLM-4.5-Air config.json
    vocab=151552,
    embed=4096,
    layers=46,
    heads=96,
    kv_heads=8,
    head_dim=128,
    experts=128,
    top_k=8,
    expert_dim=1408,
    mlp_dim=10944,
    dense_layers=1,
    shared_experts=1,
    theta=1e6,
    rotary_dim=64,  # partial_rotary_factor 0.5
    attention_bias=True,
    qk_norm=False,
    scaling_factor=1.0,
)
_FULL = dict(  # zai-org/GLM-4.5 config.json
    vocab=151552,
    embed=5120,
    layers=92,
    heads=96,
    kv_heads=8,
    head_dim=128,
    experts=160,
    top_k=8,
    expert_dim=1536,
    mlp_dim=12288,
    dense_layers=3,
    shared_experts=1,
    theta=1e6,
    rotary_dim=64,  # partial_rotary_factor 0.5
    attention_bias=True,
    qk_norm=True,
    scaling_factor=2.5,
)

PRESETS: dict[str, ModelConfig] = {
    # Both: n_group 1, topk_group 1, norm_topk_prob true, rms_norm_eps 1e-5, max_position_embeddings 131072,
    # untied; the 47th (Air) or 93rd layer of their checkpoints is the MTP layer (SKIPPED_KEYS).
    "glm-4.5-air": _glm4_moe(**_AIR),
    "glm-4.5": _glm4_moe(**_FULL),
}


# --- Hugging Face config.json: transformers' Glm4MoeConfig ----------------------------------------------

# transformers' Glm4MoePreTrainedModel._keys_to_ignore_on_load_unexpected: the MTP layer after GLM-4.5's 92
# and GLM-4.5-Air's 46 decoder layers. Skipped only where the config expects no such tensor.
SKIPPED_KEYS = (r"model\.layers\.92.*", r"model\.layers\.46.*")


FIELD_MAP = FieldMap(
    model_type=NAME,
    architecture="Glm4MoeForCausalLM",
    label="GLM-4.5 MoE",
    template=PRESETS["glm-4.5-air"],
    entries=(
        *decoder_fields(kv_default=8, eps=1e-5),
        Field("intermediate_size", "mlp_dim", kind="positive"),
        expert_widths_rule("GLM-4.5 MoE"),
        Field("n_routed_experts", "moe.router.num_experts", 128, kind="positive", aliases=("num_local_experts",)),
        Field("num_experts_per_tok", "moe.router.top_k", 8, kind="positive"),
        Field("n_shared_experts", "moe.shared_experts", 1, kind="positive", write=positive_shared),
        Field("routed_scaling_factor", "moe.router.routed_scaling_factor", 1.0, kind="positive_number", read=float),
        Field("n_group", "moe.router.expert_groups", 1, kind="positive"),
        Field("topk_group", "moe.router.expert_groups_kept", 1, kind="positive"),
        Field("norm_topk_prob", "moe.router.renormalize", True, kind="bool"),
        Field(
            "use_qk_norm",
            "attention.qk_norm",
            False,
            kind="bool",
            read=lambda on: "before_rope" if on else "none",
            write=on_off("before_rope", "none", "use_qk_norm"),
        ),
        Field(
            "attention_bias",
            "attention.bias",
            False,
            kind="bool",
            read=lambda on: "qkv" if on else "none",
            write=on_off("qkv", "none", "attention_bias: q, k and v; o_proj has none"),
        ),
        dense_first_rule("GLM-4.5 MoE", 1),
        selection_bias_rule("GLM-4.5 MoE"),
        rope_rule(131072, "GLM-4.5 MoE", partial_default=0.5),
        Fixed("hidden_act", "silu"),
        Fixed("attention_dropout", 0.0),
        # The multi-token-prediction layers' count: transformers builds no module for them and skips their
        # tensors on load (_keys_to_ignore_on_load_unexpected), as eqmoe does (SKIPPED_KEYS).
        Known(("num_nextn_predict_layers", "num_mtp_layers")),
    ),
)


def config_from_hf(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face GLM-4.5 MoE ``config.json`` dictionary (:data:`FIELD_MAP`).
    Fields left out take Glm4MoeConfig's defaults, as transformers reads them (``partial_rotary_factor`` 0.5);
    the widths and depth are required so that a truncated file is not read as a GLM-4.5-Air."""
    return FIELD_MAP.read(hf, source)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dictionary for ``config``; a ``ValueError`` names the first field that
    transformers' GLM-4.5 MoE cannot express (:data:`FIELD_MAP`). The objective (``config.loss``) is not part of
    the checkpoint and is not written."""
    return FIELD_MAP.write(config)


# --- Checkpoint name map ---------------------------------------------------------------------------


def checkpoint_names(config: ModelConfig) -> list[TensorName]:
    """Every tensor of a Hugging Face GLM-4.5 MoE checkpoint for ``config``, in the Hub's key names (those
    transformers' ``save_pretrained`` writes): Qwen3-MoE's (:func:`eqmoe.models.qwen3_moe.checkpoint_names`:
    norms, projections, QK-norm, dense MLPs, router gate and per-expert ``gate/up/down_proj``) plus the q/k/v
    biases, each MoE layer's ``e_score_correction_bias`` and its shared experts."""
    names = qwen3_moe.checkpoint_names(config)
    for layer, s, r, u, kind in layer_slots(config):
        if kind.ffn == "moe":
            block, prefix = ("segments", s, "blocks", u, "ffn"), f"model.layers.{layer}.mlp."
            if config.moe.router.bias_update_rate > 0:  # DeepSeek-V2's router has no selection bias
                names.append(TensorName(prefix + "gate.e_score_correction_bias", (*block, "router", "bias"), (r,)))
            names += swiglu_names(prefix + "shared_experts.", (*block, "shared_expert"), (r,))
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
        skipped_keys=SKIPPED_KEYS,
    )
)
