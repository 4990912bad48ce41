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
    segments_from_kinds,
)
from eqmoe.models import hf_config, qwen3_moe
from eqmoe.models.family import Family, TensorName, layer_slots, register, swiglu_names
from eqmoe.models.hf_config import COMMON_IRRELEVANT_FIELDS, FieldList, positive_integers, require, rope_to_hf, show

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
        layers=segments_from_kinds(qwen3_moe.layer_kinds_from_hf(layers, experts, 1, list(range(dense_layers)))),
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


# --- Hugging Face config.json -------------------------------------------------------------------

# Every field a GLM-4.5 MoE config.json may hold (transformers' Glm4MoeConfig, the PreTrainedConfig fields its
# save_pretrained writes, the aliases in its attribute_map and the Hub's older top-level RoPE fields); any
# other field is refused (hf_config.check_fields).
READ_FIELDS = (  # reproduced: they set the ModelConfig
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "n_routed_experts",
    "num_local_experts",  # Glm4MoeConfig.attribute_map alias of n_routed_experts
    "num_experts_per_tok",
    "n_shared_experts",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "norm_topk_prob",
    "first_k_dense_replace",
    "use_qk_norm",
    "attention_bias",
    "partial_rotary_factor",  # the Hub's top-level form; transformers moves it into rope_parameters
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "max_position_embeddings",
)
IRRELEVANT_FIELDS = (
    *COMMON_IRRELEVANT_FIELDS,
    # The multi-token-prediction layers' count: transformers builds no module for them and skips their
    # tensors on load (_keys_to_ignore_on_load_unexpected), as eqmoe does (SKIPPED_KEYS).
    "num_nextn_predict_layers",
    "num_mtp_layers",  # Glm4MoeConfig.attribute_map alias of num_nextn_predict_layers
)
FIXED_FIELDS = {  # eqmoe computes these only at the value shown (transformers' default)
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "chunk_size_feed_forward": 0,
    "is_encoder_decoder": False,
}
FIELDS = FieldList(READ_FIELDS, IRRELEVANT_FIELDS, FIXED_FIELDS)
# Glm4MoeConfig's defaults, which transformers uses when config.json leaves a field out.
_HF_DEFAULTS = {
    "num_key_value_heads": 8,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_routed_experts": 128,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "use_qk_norm": False,
    "attention_bias": False,
    "partial_rotary_factor": 0.5,  # Glm4MoeConfig.__post_init__: kwargs.setdefault("partial_rotary_factor", 0.5)
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
}
# transformers' Glm4MoePreTrainedModel._keys_to_ignore_on_load_unexpected: the MTP layer after GLM-4.5's 92
# and GLM-4.5-Air's 46 decoder layers. Skipped only where the config expects no such tensor.
SKIPPED_KEYS = (r"model\.layers\.92.*", r"model\.layers\.46.*")


# The config.json field behind each eqmoe field a refusal may name (longest first: replaced in this order).
_HF_NAMES = (
    ("RouterConfig.expert_groups_kept", "topk_group"),
    ("RouterConfig.expert_groups", "n_group"),
    ("RouterConfig.top_k", "num_experts_per_tok"),
    ("RouterConfig.num_experts", "n_routed_experts"),
    ("AttentionConfig.num_kv_heads", "num_key_value_heads"),
)


def check_fields(hf: dict[str, Any], source: str) -> None:
    """Refuse, naming the field and ``source``, any field outside the GLM-4.5 MoE allow-list and any fixed field
    whose value eqmoe does not compute (:func:`eqmoe.models.hf_config.check_fields`)."""
    hf_config.check_fields(hf, source, FIELDS)


def _flag(hf: dict[str, Any], name: str, source: str) -> bool:
    value = hf.get(name, _HF_DEFAULTS[name])
    if not isinstance(value, bool):
        raise ValueError(f"{source}: {name}={show(value)} is invalid; allowed: true | false")
    return value


def config_from_hf(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a :class:`ModelConfig` from a Hugging Face GLM-4.5 MoE ``config.json`` dictionary.

    Fields left out take Glm4MoeConfig's defaults, as transformers reads them (``partial_rotary_factor`` 0.5,
    ``head_dim`` ``hidden_size // num_attention_heads``); the widths and depth are required so that a
    truncated file is not read as a GLM-4.5-Air.
    """
    model_type = hf.get("model_type")
    if model_type != NAME:
        raise ValueError(f"{source}: model_type {model_type!r} is not supported; allowed: {NAME!r}")
    check_fields(hf, source)
    sizes = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    )
    integers = {name: require(hf, name, source) for name in sizes}
    experts = hf.get("n_routed_experts", hf.get("num_local_experts"))
    integers["n_routed_experts"] = experts if experts is not None else _HF_DEFAULTS["n_routed_experts"]
    for name in (
        "num_key_value_heads",
        "num_experts_per_tok",
        "n_shared_experts",  # 0 would leave transformers an empty shared SwiGLU whose tensors eqmoe has no leaf for
        "n_group",
        "topk_group",
        "max_position_embeddings",
    ):
        integers[name] = hf[name] if hf.get(name) is not None else _HF_DEFAULTS[name]
    head_dim = hf.get("head_dim") or integers["hidden_size"] // integers["num_attention_heads"]
    positive_integers({**integers, "head_dim": head_dim}, source)
    dense_layers = hf.get("first_k_dense_replace", _HF_DEFAULTS["first_k_dense_replace"])
    if isinstance(dense_layers, bool) or not isinstance(dense_layers, int) or dense_layers < 0:
        raise ValueError(f"{source}: first_k_dense_replace={show(dense_layers)} is invalid; allowed: an integer >= 0")
    scaling_factor = hf.get("routed_scaling_factor", _HF_DEFAULTS["routed_scaling_factor"])
    if not hf_config.KINDS["number"](scaling_factor) or scaling_factor <= 0:
        raise ValueError(
            f"{source}: routed_scaling_factor={show(scaling_factor)} is invalid; allowed: a positive number"
        )
    flags = {name: _flag(hf, name, source) for name in ("norm_topk_prob", "use_qk_norm", "attention_bias")}
    theta, scaling = hf_config.rope_from_hf(hf, source, _HF_DEFAULTS["max_position_embeddings"], partial_rotary=True)
    rotary_dim = hf_config.rotary_dim_from_hf(hf, source, head_dim, _HF_DEFAULTS["partial_rotary_factor"])
    try:
        return _glm4_moe(
            vocab=integers["vocab_size"],
            embed=integers["hidden_size"],
            layers=integers["num_hidden_layers"],
            heads=integers["num_attention_heads"],
            kv_heads=integers["num_key_value_heads"],
            head_dim=head_dim,
            experts=integers["n_routed_experts"],
            top_k=integers["num_experts_per_tok"],
            expert_dim=integers["moe_intermediate_size"],
            mlp_dim=integers["intermediate_size"],
            dense_layers=dense_layers,
            shared_experts=integers["n_shared_experts"],
            theta=theta,
            rotary_dim=rotary_dim,
            attention_bias=flags["attention_bias"],
            qk_norm=flags["use_qk_norm"],
            scaling_factor=float(scaling_factor),
            groups=integers["n_group"],
            groups_kept=integers["topk_group"],
            renormalize=flags["norm_topk_prob"],
            rope_scaling=scaling,
            tie=bool(hf.get("tie_word_embeddings", False)),
            eps=float(hf.get("rms_norm_eps", _HF_DEFAULTS["rms_norm_eps"])),
        )
    except (TypeError, ValueError) as error:
        message = str(error)
        for ours, theirs in _HF_NAMES:
            message = message.replace(ours, theirs)
        raise ValueError(f"{source}: {message}") from None


def _dense_prefix(kinds: tuple[str, ...]) -> int | None:
    """``first_k_dense_replace`` for ``kinds`` (``k`` dense layers, then only MoE), or ``None`` if they are not."""
    k = kinds.index("moe") if "moe" in kinds else len(kinds)
    return k if set(kinds[k:]) <= {"moe"} else None


def _partial_rotary_factor(head_dim: int, rotary_dim: int | None) -> float:
    """The factor transformers turns back into ``rotary_dim`` (``int(head_dim * factor)``)."""
    if rotary_dim is None:
        return 1.0
    factor = rotary_dim / head_dim
    if int(head_dim * factor) != rotary_dim:  # float rounding: e.g. int(44 * (30 / 44)) == 29
        raise ValueError(
            f"attention.rotary_dim={rotary_dim} has no Hugging Face GLM-4.5 MoE equivalent with head_dim={head_dim} "
            f"(int(head_dim * {factor!r}) is {int(head_dim * factor)}); allowed: a width the factor reproduces"
        )
    return factor


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dictionary for ``config``; a ``ValueError`` names the first field
    that transformers' GLM-4.5 MoE cannot express.

    The router's ``bias_update_rate`` (how eqmoe keeps moving the selection bias) may be any positive rate: the
    bias itself is written as ``e_score_correction_bias``, which transformers never updates. The objective
    (``config.loss``) is not part of the checkpoint and is not written.
    """
    moe = config.moe
    if moe is None:
        raise ValueError("moe=None has no Hugging Face GLM-4.5 MoE equivalent; a MoEConfig is needed")
    router, attention = moe.router, config.attention
    kinds = config.layer_kinds()
    dense_layers = _dense_prefix(kinds)
    if dense_layers is None:
        raise ValueError(f"layers={kinds!r} has no Hugging Face GLM-4.5 MoE equivalent; allowed: 'dense, then moe'")
    expressible = {
        "attention.qk_norm": ("none", "before_rope"),
        "attention.bias": ("none", "qkv"),
        "attention.rotary_dim": hf_config.ANY,
        "moe.router.strategy": ("sigmoid_top_k",),
        "moe.router.renormalize": hf_config.ANY,
        "moe.router.bias_update_rate": hf_config.ANY,
        "moe.router.routed_scaling_factor": hf_config.ANY,
        "moe.router.expert_groups": hf_config.ANY,
        "moe.router.expert_groups_kept": hf_config.ANY,
        "moe.shared_experts": hf_config.ANY,
        "moe.shared_expert_dim": (None, moe.expert_dim),  # one SwiGLU of moe_intermediate_size * n_shared_experts
    }
    hf_config.check_expressible(config, "GLM-4.5 MoE", expressible)
    # transformers always holds e_score_correction_bias and a shared SwiGLU; eqmoe holds the bias only with a
    # positive update rate, and a shared SwiGLU only with shared experts
    for name, value in (
        ("moe.router.bias_update_rate", router.bias_update_rate),
        ("moe.shared_experts", moe.shared_experts),
    ):
        if value <= 0:
            raise ValueError(f"{name}={value!r} has no Hugging Face GLM-4.5 MoE equivalent; allowed: a positive number")
    factor = _partial_rotary_factor(attention.head_dim, attention.rotary_dim)
    max_positions = attention.rope_scaling.max_position_embeddings if attention.rope_scaling else None
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": NAME,
        "vocab_size": config.vocab_size,
        "hidden_size": config.embed_dim,
        "intermediate_size": config.mlp_dim or moe.expert_dim,
        "moe_intermediate_size": moe.expert_dim,
        "num_hidden_layers": len(kinds),
        "num_attention_heads": attention.num_heads,
        "num_key_value_heads": attention.num_kv_heads,
        "head_dim": attention.head_dim,
        "n_routed_experts": router.num_experts,
        "num_experts_per_tok": router.top_k,
        "n_shared_experts": moe.shared_experts,
        "routed_scaling_factor": router.routed_scaling_factor,
        "n_group": router.expert_groups,
        "topk_group": router.expert_groups if router.expert_groups_kept is None else router.expert_groups_kept,
        "norm_topk_prob": router.renormalize,
        "first_k_dense_replace": dense_layers,
        "use_qk_norm": attention.qk_norm == "before_rope",
        "attention_bias": attention.bias == "qkv",
        "rms_norm_eps": config.norm.eps,
        "rope_parameters": rope_to_hf(attention.rope_theta, attention.rope_scaling, partial_rotary_factor=factor),
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "max_position_embeddings": max_positions or _HF_DEFAULTS["max_position_embeddings"],
        "dtype": config.param_dtype,
    }


# --- Checkpoint name map ---------------------------------------------------------------------------


def checkpoint_names(config: ModelConfig) -> list[TensorName]:
    """Every tensor of a Hugging Face GLM-4.5 MoE checkpoint for ``config``, in the Hub's key names (those
    transformers' ``save_pretrained`` writes): Qwen3-MoE's (:func:`eqmoe.models.qwen3_moe.checkpoint_names`:
    norms, projections, QK-norm, dense MLPs, router gate and per-expert ``gate/up/down_proj``) plus the q/k/v
    biases, each MoE layer's ``e_score_correction_bias`` and its shared experts."""
    names = qwen3_moe.checkpoint_names(config)
    for layer, s, r, u, kind in layer_slots(config):
        if kind == "moe":
            block, prefix = ("segments", s, "blocks", u, "ffn"), f"model.layers.{layer}.mlp."
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
        checkpoint_names=checkpoint_names,
        skipped_keys=SKIPPED_KEYS,
    )
)
