"""The Mixtral family (Hugging Face ``model_type`` ``"mixtral"``): published presets, the ``config.json`` reader
and writer and the checkpoint name map.

Mixtral is Qwen3-MoE's decoder without QK-norm: every layer is MoE, the router takes a float32 softmax over all
experts, keeps the top-k and divides them by their sum (eqmoe's ``softmax_top_k`` with ``renormalize``), and
the auxiliary loss is transformers' pooled ``load_balancing_loss_func`` (eqmoe's ``hf_pooled``).
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
from eqmoe.models import hf_config
from eqmoe.models.family import Family, TensorName, attention_names, layer_slots, outer_names, register
from eqmoe.models.hf_config import COMMON_IRRELEVANT_FIELDS, FieldList, positive_integers, require, rope_to_hf, show

NAME = "mixtral"


def _mixtral(
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
    theta: float,
    rope_scaling: RopeScaling | None = None,
    tie: bool = False,
    eps: float = 1e-5,
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
        ),
        layers=segments_from_kinds(["moe"] * layers),
        moe=MoEConfig(
            router=RouterConfig(num_experts=experts, top_k=top_k, strategy="softmax_top_k", renormalize=True),
            expert_dim=expert_dim,
        ),
        norm=NormConfig(eps=eps, ffn_placement="pre"),
        loss=LossConfig(load_balance="hf_pooled", load_balance_weight=aux_coef),
        tie_embeddings=tie,
        family=NAME,
    )


PRESETS: dict[str, ModelConfig] = {
    # mistralai/Mixtral-8x7B-v0.1 config.json (rope_theta 1e6, rms_norm_eps 1e-5, sliding_window null).
    "mixtral-8x7b": _mixtral(
        vocab=32000,
        embed=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        head_dim=128,
        experts=8,
        top_k=2,
        expert_dim=14336,
        theta=1e6,
    ),
}


# --- Hugging Face config.json -------------------------------------------------------------------

# Every field a Mixtral config.json may hold (transformers' MixtralConfig, the PreTrainedConfig fields its
# save_pretrained writes, and the older top-level rope_theta / rope_scaling); any other field is refused.
READ_FIELDS = (  # reproduced: they set the ModelConfig
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_local_experts",
    "num_experts",  # MixtralConfig.attribute_map alias of num_local_experts
    "num_experts_per_tok",
    "rms_norm_eps",
    "tie_word_embeddings",
    "router_aux_loss_coef",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "max_position_embeddings",
    "sliding_window",  # must be null: eqmoe has no sliding-window attention
)
FIXED_FIELDS = {  # eqmoe computes these only at the value shown (transformers' default)
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "router_jitter_noise": 0.0,
    "chunk_size_feed_forward": 0,
    "is_encoder_decoder": False,
}
FIELDS = FieldList(READ_FIELDS, COMMON_IRRELEVANT_FIELDS, FIXED_FIELDS)
# MixtralConfig's defaults, which transformers uses when config.json leaves a field out.
_HF_DEFAULTS = {
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-5,
    "router_aux_loss_coef": 0.001,
    "max_position_embeddings": 4096 * 32,
}


def check_fields(hf: dict[str, Any], source: str) -> None:
    """Refuse, naming the field and ``source``, any field outside the Mixtral allow-list, any fixed field at
    another value, and a non-null ``sliding_window`` (transformers would mask attention to a window that eqmoe
    does not, so logits past the window would differ)."""
    hf_config.check_fields(hf, source, FIELDS)
    if hf.get("sliding_window") is not None:
        raise ValueError(
            f"{source}: sliding_window={show(hf['sliding_window'])} is not supported "
            "(eqmoe has no sliding-window attention); allowed: null"
        )


def config_from_hf(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a :class:`ModelConfig` from a Hugging Face Mixtral ``config.json`` dictionary.

    Fields left out take MixtralConfig's defaults, as transformers reads them (``num_key_value_heads`` 8,
    ``head_dim`` ``hidden_size // num_attention_heads``); the widths and depth are required so that a
    truncated file is not read as an 8x7B.
    """
    model_type = hf.get("model_type")
    if model_type != NAME:
        raise ValueError(f"{source}: model_type {model_type!r} is not supported; allowed: {NAME!r}")
    check_fields(hf, source)
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    integers = {name: require(hf, name, source) for name in sizes}
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    for name in ("num_key_value_heads", "num_experts_per_tok", "max_position_embeddings"):
        integers[name] = hf[name] if hf.get(name) is not None else _HF_DEFAULTS[name]
    integers["num_local_experts"] = experts if experts is not None else _HF_DEFAULTS["num_local_experts"]
    head_dim = hf.get("head_dim") or integers["hidden_size"] // integers["num_attention_heads"]
    positive_integers({**integers, "head_dim": head_dim}, source)
    theta, scaling = hf_config.rope_from_hf(hf, source, _HF_DEFAULTS["max_position_embeddings"])
    try:
        return _mixtral(
            vocab=integers["vocab_size"],
            embed=integers["hidden_size"],
            layers=integers["num_hidden_layers"],
            heads=integers["num_attention_heads"],
            kv_heads=integers["num_key_value_heads"],
            head_dim=head_dim,
            experts=integers["num_local_experts"],
            top_k=integers["num_experts_per_tok"],
            expert_dim=integers["intermediate_size"],
            theta=theta,
            rope_scaling=scaling,
            tie=bool(hf.get("tie_word_embeddings", False)),
            eps=float(hf.get("rms_norm_eps", _HF_DEFAULTS["rms_norm_eps"])),
            aux_coef=float(hf.get("router_aux_loss_coef", _HF_DEFAULTS["router_aux_loss_coef"])),
        )
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: {error}") from None


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dictionary for ``config``; a ``ValueError`` names the first field
    that transformers' Mixtral cannot express."""
    moe = config.moe
    router = moe.router if moe else None
    if set(config.layer_kinds()) != {"moe"}:
        raise ValueError("layers='dense layers' has no Hugging Face Mixtral equivalent; allowed: 'moe'")
    hf_config.check_expressible(config, "Mixtral", {"attention.qk_norm": ("none",)})
    attention = config.attention
    max_positions = attention.rope_scaling.max_position_embeddings if attention.rope_scaling else None
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": NAME,
        "vocab_size": config.vocab_size,
        "hidden_size": config.embed_dim,
        "intermediate_size": moe.expert_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": attention.num_heads,
        "num_key_value_heads": attention.num_kv_heads,
        "head_dim": attention.head_dim,
        "num_local_experts": router.num_experts,
        "num_experts_per_tok": router.top_k,
        "rms_norm_eps": config.norm.eps,
        "rope_parameters": rope_to_hf(attention.rope_theta, attention.rope_scaling),
        "tie_word_embeddings": config.tie_embeddings,
        "router_aux_loss_coef": config.loss.load_balance_weight,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "max_position_embeddings": max_positions or _HF_DEFAULTS["max_position_embeddings"],
        "dtype": config.param_dtype,
    }


# --- Checkpoint name map ---------------------------------------------------------------------------

# Hub expert names: w1 = gate, w3 = up, w2 = down (transformers 5 fuses them on load and splits them on save).
_EXPERT_WEIGHTS = (("w1", "w_gate"), ("w3", "w_up"), ("w2", "w_down"))


def checkpoint_names(config: ModelConfig) -> list[TensorName]:
    """Every tensor of a Hugging Face Mixtral checkpoint for ``config``, in the Hub's key names (those
    transformers' ``save_pretrained`` writes: ``block_sparse_moe.gate`` and ``experts.{j}.w1/w2/w3``)."""
    names = outer_names(config)
    for layer, s, r, u, _kind in layer_slots(config):
        block = ("segments", s, "blocks", u)
        prefix = f"model.layers.{layer}."
        names += attention_names(prefix, block, r, config.attention)
        names.append(TensorName(prefix + "block_sparse_moe.gate.weight", (*block, "ffn", "router", "weight"), (r,), 1))
        for j in range(config.moe.router.num_experts):
            for hub, leaf in _EXPERT_WEIGHTS:
                key = prefix + f"block_sparse_moe.experts.{j}.{hub}.weight"
                names.append(TensorName(key, (*block, "ffn", "experts", leaf), (r, j), 1))
    return names


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
