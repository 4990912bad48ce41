"""The Qwen2-MoE family (Hugging Face ``model_type`` ``"qwen2_moe"``: Qwen1.5-MoE and Qwen2-MoE): published
presets, the ``config.json`` reader and writer and the checkpoint name map.

Qwen2-MoE is Qwen3-MoE's decoder with biases on the query/key/value projections (``qkv_bias``) instead of
QK-norm, and a shared expert in every MoE block: a SwiGLU of width ``shared_expert_intermediate_size`` that
sees every token, multiplied by ``sigmoid(x @ shared_expert_gate)`` and added to the routed output (eqmoe's
``shared_experts=1`` with ``shared_expert_gate``). The router, the dense/MoE layer layout
(``decoder_sparse_step``, ``mlp_only_layers``) and the auxiliary loss (the pooled ``load_balancing_loss_func``,
eqmoe's ``hf_pooled``) are Qwen3-MoE's.
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
        layers=segments_from_kinds(kinds or ["moe"] * layers),
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


# --- Hugging Face config.json -------------------------------------------------------------------

# Every field a Qwen2-MoE config.json may hold (transformers' Qwen2MoeConfig, the PreTrainedConfig fields its
# save_pretrained writes, and the older top-level rope_theta / rope_scaling of the Hub's files); any other
# field is refused. Qwen2MoeConfig has no attribute_map, so num_local_experts (Mixtral's name) would be
# ignored by transformers and is refused here as unknown.
READ_FIELDS = (  # reproduced: they set the ModelConfig
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",  # not a Qwen2MoeConfig field, but its attention and RoPE read it when present
    "num_experts",
    "num_experts_per_tok",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "qkv_bias",
    "rms_norm_eps",
    "tie_word_embeddings",
    "router_aux_loss_coef",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "max_position_embeddings",
    "layer_types",  # must be all "full_attention": eqmoe has no sliding-window attention
)
IRRELEVANT_FIELDS = (  # change nothing eqmoe computes from the weights: metadata, token ids, output switches
    *COMMON_IRRELEVANT_FIELDS,
    "sliding_window",  # read only with use_sliding_window (transformers sets it to 0 otherwise)
    "max_window_layers",  # only places sliding layers, which use_sliding_window=false rules out
)
FIXED_FIELDS = {  # eqmoe computes these only at the value shown (transformers' default)
    "hidden_act": "silu",
    "use_sliding_window": False,
    "attention_dropout": 0.0,
    "chunk_size_feed_forward": 0,
    "is_encoder_decoder": False,
}
FIELDS = FieldList(READ_FIELDS, IRRELEVANT_FIELDS, FIXED_FIELDS)
# Qwen2MoeConfig's defaults, which transformers uses when config.json leaves a field out. Note that
# num_key_value_heads defaults to 16, not to num_attention_heads.
_HF_DEFAULTS = {
    "num_key_value_heads": 16,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "router_aux_loss_coef": 0.001,
}


def check_fields(hf: dict[str, Any], source: str) -> None:
    """Refuse, naming the field and ``source``, any field outside the Qwen2-MoE allow-list, any fixed field at
    another value (``use_sliding_window: true`` among them), and ``layer_types`` with any layer other than
    ``"full_attention"`` (transformers would give that layer a sliding-window mask eqmoe does not compute)."""
    hf_config.check_fields(hf, source, FIELDS)
    layer_types = hf.get("layer_types")
    if layer_types is not None and (
        not isinstance(layer_types, list) or any(kind != "full_attention" for kind in layer_types)
    ):
        raise ValueError(
            f"{source}: layer_types={show(layer_types)} is not supported "
            '(eqmoe has no sliding-window attention); allowed: null or a list of "full_attention"'
        )


def _integer(hf: dict[str, Any], name: str) -> Any:
    """``hf[name]``, or Qwen2MoeConfig's default when the field is absent (a null is kept, to be refused)."""
    return hf[name] if name in hf else _HF_DEFAULTS[name]


def config_from_hf(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a :class:`ModelConfig` from a Hugging Face Qwen2-MoE ``config.json`` dictionary.

    Fields left out take Qwen2MoeConfig's defaults, as transformers reads them (``num_key_value_heads`` 16,
    ``qkv_bias`` true, ``head_dim`` ``hidden_size // num_attention_heads``); the widths and the depth are
    required so that a truncated file is not read as a Qwen1.5-MoE-A2.7B. ``shared_expert_intermediate_size``
    0, which transformers builds as a shared expert that adds nothing, is refused: eqmoe's shared experts have
    a positive width, and without them the checkpoint's ``shared_expert_gate`` would have nowhere to go.
    """
    model_type = hf.get("model_type")
    if model_type != NAME:
        raise ValueError(f"{source}: model_type {model_type!r} is not supported; allowed: {NAME!r}")
    check_fields(hf, source)
    sizes = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
    )
    integers = {name: require(hf, name, source) for name in sizes}
    for name in ("num_key_value_heads", "num_experts", "num_experts_per_tok", "decoder_sparse_step"):
        integers[name] = _integer(hf, name)
    if "max_position_embeddings" in hf:
        integers["max_position_embeddings"] = hf["max_position_embeddings"]
    if type(hf["shared_expert_intermediate_size"]) is int and hf["shared_expert_intermediate_size"] == 0:
        raise ValueError(
            f"{source}: shared_expert_intermediate_size=0 is not supported "
            "(eqmoe's shared expert has a positive width); allowed: a positive integer"
        )
    positive_integers(integers, source)
    mlp_only = hf.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
        raise ValueError(f"{source}: mlp_only_layers={show(mlp_only)} is invalid; allowed: a list of layer indices")
    kinds = qwen3_moe.layer_kinds_from_hf(
        integers["num_hidden_layers"], integers["num_experts"], integers["decoder_sparse_step"], mlp_only
    )
    if "moe" not in kinds:
        raise ValueError(
            f"{source}: mlp_only_layers={show(mlp_only)} with decoder_sparse_step={integers['decoder_sparse_step']} "
            "leaves no MoE layer; allowed: at least one MoE layer"
        )
    layer_types = hf.get("layer_types")
    if layer_types is not None and len(layer_types) != integers["num_hidden_layers"]:
        raise ValueError(
            f"{source}: layer_types has {len(layer_types)} entries; allowed: num_hidden_layers="
            f"{integers['num_hidden_layers']}"
        )
    if "dense" in kinds:
        require(hf, "intermediate_size", source)
    mlp_dim = hf.get("intermediate_size")
    head_dim = hf.get("head_dim") or integers["hidden_size"] // integers["num_attention_heads"]
    positive_integers({"head_dim": head_dim, **({"intermediate_size": mlp_dim} if mlp_dim is not None else {})}, source)
    for name in ("qkv_bias", "norm_topk_prob", "tie_word_embeddings"):
        if name in hf and not isinstance(hf[name], bool):
            raise ValueError(f"{source}: {name}={show(hf[name])} is invalid; allowed: true | false")
    theta, scaling = hf_config.rope_from_hf(hf, source, _HF_DEFAULTS["max_position_embeddings"])
    try:
        return _qwen2_moe(
            vocab=integers["vocab_size"],
            embed=integers["hidden_size"],
            layers=integers["num_hidden_layers"],
            heads=integers["num_attention_heads"],
            kv_heads=integers["num_key_value_heads"],
            head_dim=head_dim,
            experts=integers["num_experts"],
            top_k=integers["num_experts_per_tok"],
            expert_dim=integers["moe_intermediate_size"],
            shared_dim=integers["shared_expert_intermediate_size"],
            mlp_dim=mlp_dim,
            theta=theta,
            rope_scaling=scaling,
            kinds=kinds,
            qkv_bias=hf.get("qkv_bias", True),
            tie=hf.get("tie_word_embeddings", False),
            renormalize=hf.get("norm_topk_prob", False),
            eps=float(hf.get("rms_norm_eps", _HF_DEFAULTS["rms_norm_eps"])),
            aux_coef=float(hf.get("router_aux_loss_coef", _HF_DEFAULTS["router_aux_loss_coef"])),
        )
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: {error}") from None


def _sparse_layout(kinds: tuple[str, ...]) -> tuple[int, list[int]]:
    """``(decoder_sparse_step, mlp_only_layers)`` that give ``kinds`` under transformers' rule, with the
    shortest ``mlp_only_layers`` (then the smallest step): a file written by transformers with
    ``decoder_sparse_step=2`` and no ``mlp_only_layers`` comes back as it was."""
    layouts = []
    for step in range(1, len(kinds) + 1):
        if all((i + 1) % step == 0 for i, kind in enumerate(kinds) if kind == "moe"):
            dense = [i for i, kind in enumerate(kinds) if kind == "dense" and (i + 1) % step == 0]
            layouts.append((len(dense), step, dense))
    _, step, dense = min(layouts)
    return step, dense


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dictionary for ``config``; a ``ValueError`` names the first field
    that transformers' Qwen2-MoE cannot express."""
    moe = config.moe
    if moe is None or "moe" not in config.layer_kinds():
        raise ValueError("moe=None has no Hugging Face Qwen2-MoE equivalent; at least one MoE layer is needed")
    router, attention = moe.router, config.attention
    if moe.shared_experts < 1:  # transformers' MoE block always has a gated shared expert of positive width
        raise ValueError(
            "moe.shared_experts=0 has no Hugging Face Qwen2-MoE equivalent; allowed: >= 1 (with shared_expert_gate)"
        )
    expressible = {
        "attention.qk_norm": ("none",),
        "attention.bias": ("qkv", "none"),  # qkv_bias true / false; o_proj has none
        "moe.router.renormalize": hf_config.ANY,
        "moe.shared_experts": hf_config.ANY,  # written as one shared expert of their summed width
        "moe.shared_expert_dim": hf_config.ANY,
        "moe.shared_expert_gate": (True,),  # every HF MoE block gates its shared expert
    }
    hf_config.check_expressible(config, "Qwen2-MoE", expressible)
    kinds = config.layer_kinds()
    step, mlp_only = _sparse_layout(kinds)
    max_positions = attention.rope_scaling.max_position_embeddings if attention.rope_scaling else None
    hf = {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": NAME,
        "vocab_size": config.vocab_size,
        "hidden_size": config.embed_dim,
        "moe_intermediate_size": moe.expert_dim,
        # Several shared experts are one SwiGLU of their summed width, which is what transformers builds.
        "shared_expert_intermediate_size": moe.shared_width,
        "num_hidden_layers": len(kinds),
        "num_attention_heads": attention.num_heads,
        "num_key_value_heads": attention.num_kv_heads,
        "num_experts": router.num_experts,
        "num_experts_per_tok": router.top_k,
        "norm_topk_prob": router.renormalize,
        "decoder_sparse_step": step,
        "mlp_only_layers": mlp_only,
        "qkv_bias": attention.bias == "qkv",
        "rms_norm_eps": config.norm.eps,
        "rope_parameters": rope_to_hf(attention.rope_theta, attention.rope_scaling),
        "tie_word_embeddings": config.tie_embeddings,
        "router_aux_loss_coef": config.loss.load_balance_weight,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "max_position_embeddings": max_positions or _HF_DEFAULTS["max_position_embeddings"],
        "dtype": config.param_dtype,
    }
    if config.mlp_dim is not None:  # absent: transformers' default, unused when every layer is MoE
        hf["intermediate_size"] = config.mlp_dim
    if attention.head_dim != config.embed_dim // attention.num_heads:  # written only when not the derived one
        hf["head_dim"] = attention.head_dim
    return hf


# --- Checkpoint name map ---------------------------------------------------------------------------


def checkpoint_names(config: ModelConfig) -> list[TensorName]:
    """Every tensor of a Hugging Face Qwen2-MoE checkpoint for ``config``, in the Hub's key names (those
    transformers' ``save_pretrained`` writes): Qwen3-MoE's (:func:`eqmoe.models.qwen3_moe.checkpoint_names`:
    norms, projections and their biases, dense MLPs, router gate and per-expert ``gate/up/down_proj``) plus each
    MoE layer's ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate``."""
    names = qwen3_moe.checkpoint_names(config)
    for layer, s, r, u, kind in layer_slots(config):
        if kind == "moe":
            block, prefix = ("segments", s, "blocks", u, "ffn"), f"model.layers.{layer}.mlp."
            names += swiglu_names(prefix + "shared_expert.", (*block, "shared_expert"), (r,))
            names.append(TensorName(prefix + "shared_expert_gate.weight", (*block, "shared_gate"), (r,), 1))
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
