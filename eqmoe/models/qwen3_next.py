"""The Qwen3-Next family (Hugging Face ``model_type`` ``"qwen3_next"``): hybrid linear-attention MoE.

Three gated DeltaNet layers (the ``gated_deltanet`` attention kind, Qwen3-Next's fused grouped ``in_proj_qkvz`` /
``in_proj_ba``) before every full-attention layer (``layer_types``, or every ``full_attention_interval``-th layer);
the full attention gates its output (``AttentionConfig.output_gate``), norms queries and keys and rotates a quarter
of each head (``partial_rotary_factor`` 0.25); every norm is the zero-centred ``(1 + w)`` RMSNorm
(``NormConfig.zero_centered``); the MoE is Qwen2-MoE's: softmax top-k over many small experts plus one shared expert
behind a sigmoid gate.

The published files hold a multi-token-prediction layer after the decoder (``mtp.*``, ``mtp_num_hidden_layers: 1``),
which transformers does not load: eqmoe keeps it in the model's ``mtp`` part (:class:`eqmoe.nn.mtp.MTPLayer`: the
norms of the embedding and of the hidden state, ``fc`` over both, one gated full-attention block with the MoE, a final
norm; the model's own embedding and output head), outside the causal LM's loss unless ``LossConfig.mtp_weight`` asks,
and exports it back. A folder without those tensors (transformers' own saves) loads without it.
"""

from collections.abc import Callable, Mapping
from typing import Any

from eqmoe.config import (
    AttentionConfig,
    LayerKind,
    LinearAttentionConfig,
    LossConfig,
    ModelConfig,
    MoEConfig,
    NormConfig,
    RouterConfig,
)
from eqmoe.models.family import Family, TensorName, attention_names, layer_slots, register, swiglu_names
from eqmoe.models.field_map import Field, FieldMap, Fixed, Rule, show
from eqmoe.models.hf_config import _integer, _sparse_layout, decoder_fields, layer_kinds_from_hf, rope_rule
from eqmoe.models.qwen2_moe import _shared_read, _shared_write

NAME = "qwen3_next"
LINEAR, FULL = "gated_deltanet", "gqa"
_HF_KINDS = {"linear_attention": LINEAR, "full_attention": FULL}


def hybrid(
    *,
    vocab: int,
    embed: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    linear: LinearAttentionConfig,
    experts: int,
    top_k: int,
    expert_dim: int,
    shared_dim: int,
    mlp_dim: int | None,
    theta: float,
    family: str,
    interval: int = 4,
    eps: float = 1e-6,
    tie: bool = False,
    mtp_layers: int = 0,
) -> ModelConfig:
    """A Qwen3-Next-style model: ``layers`` layers, every ``interval``-th full attention, the rest linear."""
    kinds = tuple(LayerKind(attention=LINEAR if (i + 1) % interval else FULL, ffn="moe") for i in range(layers))
    return ModelConfig(
        vocab_size=vocab,
        embed_dim=embed,
        attention=AttentionConfig(
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=theta,
            rotary_dim=head_dim // 4,
            qk_norm="before_rope",
            output_gate=True,
            linear=linear,
        ),
        layers=kinds,
        mlp_dim=mlp_dim,
        moe=MoEConfig(
            router=RouterConfig(num_experts=experts, top_k=top_k, strategy="softmax_top_k", renormalize=True),
            expert_dim=expert_dim,
            shared_experts=1,
            shared_expert_dim=shared_dim,
            shared_expert_gate=True,
        ),
        norm=NormConfig(eps=eps, ffn_placement="pre", zero_centered=True),
        loss=LossConfig(load_balance="hf_pooled", load_balance_weight=0.001),
        tie_embeddings=tie,
        mtp_layers=mtp_layers,
        family=family,
    )


PRESETS: dict[str, ModelConfig] = {
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json: 48 layers (full_attention_interval 4), hidden 2048, 16 query and 2
    # key/value heads of 256 (partial_rotary_factor 0.25, rope_theta 1e7), linear attention 16 key heads and 32 value
    # heads of 128, 512 experts top-10 of width 512 plus a shared expert of 512, intermediate_size 5120.
    "qwen3-next-80b-a3b": hybrid(
        vocab=151936,
        embed=2048,
        layers=48,
        heads=16,
        kv_heads=2,
        head_dim=256,
        linear=LinearAttentionConfig(
            key_heads=16, value_heads=32, key_head_dim=128, value_head_dim=128, projection="grouped"
        ),
        experts=512,
        top_k=10,
        expert_dim=512,
        shared_dim=512,
        mlp_dim=5120,
        theta=1e7,
        family=NAME,
    ),
}


# --- Hugging Face config.json: transformers' Qwen3NextConfig ----------------------------------------------


def attention_kinds(hf: Mapping[str, Any], source: str, layers: int) -> list[str]:
    """Each layer's attention kind from ``layer_types`` (``linear_attention`` | ``full_attention``), or, without
    it, every ``full_attention_interval``-th layer (default 4) full and the rest linear, as transformers builds it."""
    layer_types = hf.get("layer_types")
    if layer_types is None:
        interval = _integer(hf, "full_attention_interval", 4, source)
        return [LINEAR if (i + 1) % interval else FULL for i in range(layers)]
    if not isinstance(layer_types, list) or any(kind not in _HF_KINDS for kind in layer_types):
        raise ValueError(
            f'{source}: layer_types={show(layer_types)} is not supported; allowed: a list of "linear_attention" | '
            '"full_attention"'
        )
    if len(layer_types) != layers:
        raise ValueError(f"{source}: layer_types has {len(layer_types)} entries; allowed: num_hidden_layers={layers}")
    return [_HF_KINDS[kind] for kind in layer_types]


def layer_types(config: ModelConfig, label: str) -> list[str]:
    """``layer_types`` of ``config``; a ``ValueError`` for an attention kind the format has no name for."""
    names = {kind: name for name, kind in _HF_KINDS.items()}
    for layer in config.layers:
        if layer.attention not in names or layer.window is not None:
            raise ValueError(
                f"layers={[str(layer) for layer in config.layers]!r} has no Hugging Face {label} equivalent; allowed: "
                "gated_deltanet | gqa attention without a window"
            )
    return [names[layer.attention] for layer in config.layers]


def _layout_rule(label: str) -> Rule:
    """``num_hidden_layers``, ``layer_types`` (or ``full_attention_interval``), ``decoder_sparse_step`` and
    ``mlp_only_layers`` <-> ``layers``: each layer's attention kind and FFN kind."""

    def read(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        if "num_hidden_layers" not in hf:
            raise ValueError(f"{source}: missing field 'num_hidden_layers'")
        layers = _integer(hf, "num_hidden_layers", None, source)
        step = _integer(hf, "decoder_sparse_step", 1, source)
        mlp_only = hf.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
            raise ValueError(f"{source}: mlp_only_layers={show(mlp_only)} is invalid; allowed: a list of layer indices")
        experts = hf.get("num_experts", 512)
        ffns = layer_kinds_from_hf(layers, experts if isinstance(experts, int) else 1, step, mlp_only)
        if "dense" in ffns and hf.get("intermediate_size", 5632) is None:
            raise ValueError(f"{source}: intermediate_size=null; allowed: a positive integer (the dense layers' width)")
        kinds = attention_kinds(hf, source, layers)
        return {"layers": tuple(LayerKind(attention=a, ffn=f) for a, f in zip(kinds, ffns, strict=True))}

    def write(config: ModelConfig) -> dict[str, Any]:
        kinds = config.ffn_kinds()
        if set(kinds) - {"dense", "moe"}:
            raise ValueError(f"layers={kinds!r} has no Hugging Face {label} equivalent; allowed: dense | moe layers")
        step, mlp_only = _sparse_layout(kinds)
        return {
            "num_hidden_layers": len(kinds),
            "layer_types": layer_types(config, label),
            "decoder_sparse_step": step,
            "mlp_only_layers": mlp_only,
        }

    keys = ("num_hidden_layers", "layer_types", "full_attention_interval", "decoder_sparse_step", "mlp_only_layers")
    return Rule(keys, ("layers",), read, write)


def linear_fields() -> tuple[Field, ...]:
    """The gated DeltaNet widths, with transformers' defaults."""
    return (
        Field("linear_conv_kernel_dim", "attention.linear.conv_kernel", 4, kind="positive"),
        Field("linear_key_head_dim", "attention.linear.key_head_dim", 128, kind="positive"),
        Field("linear_value_head_dim", "attention.linear.value_head_dim", 128, kind="positive"),
        Field("linear_num_key_heads", "attention.linear.key_heads", 16, kind="positive"),
        Field("linear_num_value_heads", "attention.linear.value_heads", 32, kind="positive"),
    )


def shared_expert_rule() -> Rule:
    """``shared_expert_intermediate_size`` (default 512) <-> one gated shared expert of that width."""

    def read(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        return _shared_read({"shared_expert_intermediate_size": 512, **hf}, source)

    paths = ("moe.shared_experts", "moe.shared_expert_dim")
    return Rule(("shared_expert_intermediate_size",), paths, read, _shared_write)


def mtp_rule() -> Rule:
    """``mtp_num_hidden_layers`` (a key transformers does not read; default 0) <-> ``mtp_layers``: the
    multi-token-prediction layer the published files hold (one; a deeper predictor is refused). Written back only
    when there is one, or was one declared."""

    def read(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        value = hf.get("mtp_num_hidden_layers", 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1:
            raise ValueError(
                f"{source}: mtp_num_hidden_layers={show(value)} is not supported; allowed: 0 | 1 (eqmoe keeps one "
                "multi-token-prediction layer)"
            )
        return {"mtp_layers": value}

    def write(config: ModelConfig) -> dict[str, Any]:
        declared = config.mtp_layers if config.mtp_layers_declared is None else config.mtp_layers_declared
        return {"mtp_num_hidden_layers": declared} if declared else {}

    return Rule(("mtp_num_hidden_layers",), ("mtp_layers",), read, write)


def hybrid_fields(vocab: int, experts: int, top_k: int, label: str, rope: Rule | None = None) -> tuple:
    """What Qwen3-Next's and Qwen3.5's text configs share (their defaults are the same but for the expert counts);
    ``rope``: the family's own RoPE rule (else partial RoPE, a quarter of each head by default)."""
    return (
        *decoder_fields(kv_default=2, eps=1e-6, head_dim_default=256, nullable=False),
        *linear_fields(),
        Field("moe_intermediate_size", "moe.expert_dim", 512, kind="positive"),
        shared_expert_rule(),
        Field("num_experts", "moe.router.num_experts", experts, kind="positive"),
        Field("num_experts_per_tok", "moe.router.top_k", top_k, kind="positive"),
        Field("router_aux_loss_coef", "loss.load_balance_weight", 0.001, kind="number", read=float),
        rope or rope_rule(32768, label, partial_default=0.25),
        mtp_rule(),
        Fixed("hidden_act", "silu"),
        Fixed("attention_bias", False),
        Fixed("attention_dropout", 0.0),
    )


FIELD_MAP = FieldMap(
    model_type=NAME,
    architecture="Qwen3NextForCausalLM",
    label="Qwen3-Next",
    template=PRESETS["qwen3-next-80b-a3b"],
    entries=(
        *hybrid_fields(151936, 512, 10, "Qwen3-Next"),
        Field("intermediate_size", "mlp_dim", 5632, kind="positive"),
        Field("norm_topk_prob", "moe.router.renormalize", True, kind="bool"),
        _layout_rule("Qwen3-Next"),
    ),
)


# --- Checkpoint name map ---------------------------------------------------------------------------


def hybrid_names(config: ModelConfig, base: str = "model.") -> list[TensorName]:
    """Every tensor of a Qwen3-Next-style checkpoint, the decoder's under ``base`` (``model.``, or
    ``model.language_model.`` in Qwen3.5's multimodal files): embedding, final norm, output layer, each layer's
    norms and attention (full or linear, as its kind names them), dense MLPs, router gate, per-expert
    ``gate/up/down_proj``, ``shared_expert.*`` and ``shared_expert_gate``."""
    names = [
        TensorName(base + "embed_tokens.weight", ("embed",), ()),
        TensorName(base + "norm.weight", ("final_norm", "weight"), ()),
    ]
    if not config.tie_embeddings:
        names.append(TensorName("lm_head.weight", ("lm_head",), (), linear_in_dims=1))
    experts = config.moe.router.num_experts if config.moe else 0
    for layer, s, r, u, kind in layer_slots(config):
        block, prefix = ("segments", s, "blocks", u), f"{base}layers.{layer}."
        names += attention_names(prefix, block, r, config, kind)
        ffn, mlp = (*block, "ffn"), prefix + "mlp."
        if kind.ffn == "dense":
            names += swiglu_names(mlp, ffn, (r,))
            continue
        names += _moe_names(mlp, ffn, (r,), experts)
    return names + mtp_names(config)


def _moe_names(mlp: str, ffn: tuple, index: tuple[int, ...], experts: int) -> list[TensorName]:
    """A MoE block's router gate, per-expert projections and gated shared expert under ``mlp`` (``...mlp.``)."""
    names = [TensorName(mlp + "gate.weight", (*ffn, "router", "gate", "weight"), index, 1)]
    for j in range(experts):
        names += swiglu_names(mlp + f"experts.{j}.", (*ffn, "experts"), (*index, j))
    names += swiglu_names(mlp + "shared_expert.", (*ffn, "shared_expert"), index)
    names.append(TensorName(mlp + "shared_expert_gate.weight", (*ffn, "shared_gate", "weight"), index, 1))
    return names


def mtp_names(config: ModelConfig) -> list[TensorName]:
    """The multi-token-prediction layer as the published files name it (``mtp.*``, beside ``model.*``):
    ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``fc``, the decoder layer ``layers.0.*`` and ``norm``."""
    names = []
    for j in range(config.mtp_layers):
        path, prefix = ("mtp", j), "mtp."
        block = (*path, "block")
        names += [
            TensorName(prefix + "pre_fc_norm_embedding.weight", (*path, "enorm", "weight"), ()),
            TensorName(prefix + "pre_fc_norm_hidden.weight", (*path, "hnorm", "weight"), ()),
            TensorName(prefix + "fc.weight", (*path, "eh_proj", "weight"), (), 1),
            TensorName(prefix + "norm.weight", (*path, "head_norm", "weight"), ()),
        ]
        layer = f"{prefix}layers.{j}."
        kind = LayerKind(config.layers[-1].attention, "moe" if config.moe else "dense")  # eqmoe.nn.mtp.mtp_layer_kind
        names += attention_names(layer, block, None, config, kind)
        if config.moe is None:
            names += swiglu_names(layer + "mlp.", (*block, "ffn"), ())
        else:
            names += _moe_names(layer + "mlp.", (*block, "ffn"), (), config.moe.router.num_experts)
    return names


def hybrid_family(name: str, presets: dict, field_map: Any, names: Callable, skipped: tuple[str, ...]) -> Family:
    return register(
        Family(
            name=name,
            presets=presets,
            hf_model_type=name,
            field_map=field_map,
            checkpoint_names=names,
            skipped_keys=skipped,
        )
    )


FAMILY = hybrid_family(NAME, PRESETS, FIELD_MAP, hybrid_names, (r"^mtp\.",))
