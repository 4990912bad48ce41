"""The parts of Hugging Face ``config.json`` files several families share, as field-map pieces
(:mod:`eqmoe.models.field_map`): the RoPE rule (:mod:`eqmoe.models.hf_rope`, re-exported here), the dense/MoE layer
layout of Qwen-style files, the widths every decoder has. Errors are one line naming the key and the file, so a
refused checkpoint says what to change.
"""

from collections.abc import Callable, Mapping
from typing import Any

from eqmoe.config import LayerKind, ModelConfig
from eqmoe.models.field_map import Field, Rule, show
from eqmoe.models.hf_rope import (  # noqa: F401 (the families read the RoPE rule from here)
    ROPE_KEYS,
    head_dim_of,
    ignored_rope_keys,
    rope_from_hf,
    rope_rule,
    rope_to_hf,
    rotary_dim_from_hf,
)


def layer_kinds_from_hf(num_layers: int, num_experts: int, sparse_step: int, mlp_only: list[int]) -> list[str]:
    """HF Qwen3MoeDecoderLayer: layer ``i`` is MoE iff ``i not in mlp_only_layers and num_experts > 0 and
    (i + 1) % decoder_sparse_step == 0``; otherwise a dense SwiGLU of width ``intermediate_size``."""
    return [
        "moe" if i not in mlp_only and num_experts > 0 and (i + 1) % sparse_step == 0 else "dense"
        for i in range(num_layers)
    ]


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


def _integer(hf: Mapping[str, Any], key: str, default: Any, source: str, minimum: int = 1) -> int:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{source}: {key}={show(value)} is invalid; allowed: {allowed}")
    return value


def sparse_layout_rule(experts_of: Callable[[Mapping[str, Any]], Any], label: str) -> Rule:
    """Qwen-style files: ``num_hidden_layers``, ``decoder_sparse_step`` and ``mlp_only_layers`` (and the expert
    count ``experts_of(hf)``) <-> ``layers`` (:func:`layer_kinds_from_hf`); a dense layer needs
    ``intermediate_size``."""

    def read(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        if "num_hidden_layers" not in hf:
            raise ValueError(f"{source}: missing field 'num_hidden_layers'")
        layers = _integer(hf, "num_hidden_layers", None, source)
        step = _integer(hf, "decoder_sparse_step", 1, source)
        mlp_only = hf.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
            raise ValueError(f"{source}: mlp_only_layers={show(mlp_only)} is invalid; allowed: a list of layer indices")
        experts = experts_of(hf)
        kinds = layer_kinds_from_hf(layers, experts if isinstance(experts, int) else 1, step, mlp_only)
        if "moe" not in kinds:
            raise ValueError(
                f"{source}: mlp_only_layers={show(mlp_only)} with decoder_sparse_step={step} leaves no MoE layer; "
                "allowed: at least one MoE layer"
            )
        if "dense" in kinds and hf.get("intermediate_size") is None:
            raise ValueError(f"{source}: missing field 'intermediate_size' (the dense layers' width)")
        return {"layers": tuple(kinds)}

    def write(config: ModelConfig) -> dict[str, Any]:
        kinds = config.ffn_kinds()
        if set(kinds) - {"dense", "moe"} or any(layer != type(layer)(ffn=layer.ffn) for layer in config.layers):
            raise ValueError(f"layers={kinds!r} has no Hugging Face {label} equivalent; allowed: dense | moe layers")
        step, mlp_only = _sparse_layout(kinds)
        return {"num_hidden_layers": len(kinds), "decoder_sparse_step": step, "mlp_only_layers": mlp_only}

    return Rule(("num_hidden_layers", "decoder_sparse_step", "mlp_only_layers"), ("layers",), read, write)


def all_moe_rule(label: str) -> Rule:
    """Files whose every layer is MoE (Mixtral, OLMoE): ``num_hidden_layers`` <-> ``layers``."""

    def read(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        if "num_hidden_layers" not in hf:
            raise ValueError(f"{source}: missing field 'num_hidden_layers'")
        return {"layers": ("moe",) * _integer(hf, "num_hidden_layers", None, source)}

    def write(config: ModelConfig) -> dict[str, Any]:
        if any(layer != type(layer)(ffn="moe") for layer in config.layers):
            raise ValueError(f"layers='dense layers' has no Hugging Face {label} equivalent; allowed: 'moe'")
        return {"num_hidden_layers": config.num_layers}

    return Rule(("num_hidden_layers",), ("layers",), read, write)


def all_dense_rule(label: str) -> Rule:
    """Dense decoders (Qwen3, Llama): ``num_hidden_layers`` <-> ``layers``, every one grouped-query attention over every
    earlier key and a dense SwiGLU of width ``intermediate_size``."""

    def read(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        if "num_hidden_layers" not in hf:
            raise ValueError(f"{source}: missing field 'num_hidden_layers'")
        return {"layers": ("dense",) * _integer(hf, "num_hidden_layers", None, source)}

    def write(config: ModelConfig) -> dict[str, Any]:
        if any(layer != LayerKind(ffn="dense") for layer in config.layers):
            raise ValueError(f"layers={config.layers!r} has no Hugging Face {label} equivalent; allowed: dense layers")
        return {"num_hidden_layers": config.num_layers}

    return Rule(("num_hidden_layers",), ("layers",), read, write)


def full_attention_rule() -> Rule:
    """``layer_types`` must be null or say ``full_attention`` for every layer: transformers gives a
    ``sliding_attention`` layer a window only with ``use_sliding_window``, which these families refuse (Qwen2-MoE,
    Qwen3). Nothing is written: transformers derives the same list."""

    def read(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        layer_types = hf.get("layer_types")
        if layer_types is None:
            return {}
        if not isinstance(layer_types, list) or any(kind != "full_attention" for kind in layer_types):
            allowed = 'null or a list of "full_attention"'
            raise ValueError(f"{source}: layer_types={show(layer_types)} is not supported; allowed: {allowed}")
        if len(layer_types) != hf.get("num_hidden_layers"):
            raise ValueError(
                f"{source}: layer_types has {len(layer_types)} entries; "
                f"allowed: num_hidden_layers={hf.get('num_hidden_layers')}"
            )
        return {}

    return Rule(("layer_types",), (), read, lambda config: {})


def _head_dim_differs(config: ModelConfig) -> bool:
    return config.attention.head_dim != config.embed_dim // config.attention.num_heads


def decoder_fields(
    *,
    kv_default: Any = None,
    head_dim: bool = True,
    eps: float = 1e-6,
    tie: bool = True,
    head_dim_default: Any = head_dim_of,
    nullable: bool = True,
) -> tuple[Field, ...]:
    """The widths every decoder file has, required so that a truncated file is never read as the family's default
    model: ``vocab_size``, ``hidden_size``, ``num_attention_heads``; ``num_key_value_heads`` (default
    ``kv_default``, or the head count), ``head_dim`` (default ``head_dim_default``, ``hidden_size //
    num_attention_heads`` unless given; with ``head_dim=False`` written only when it differs from that),
    ``rms_norm_eps`` and ``tie_word_embeddings``. ``nullable=False``: a null head count or ``head_dim`` is refused
    (a strict transformers config refuses it) instead of read as absent."""
    kv = kv_default if kv_default is not None else (lambda hf: hf.get("num_attention_heads"))
    fields = [
        Field("vocab_size", "vocab_size", kind="positive"),
        Field("hidden_size", "embed_dim", kind="positive"),
        Field("num_attention_heads", "attention.num_heads", kind="positive"),
        Field("num_key_value_heads", "attention.num_kv_heads", kv, kind="positive", nullable=nullable),
        Field(
            "head_dim",
            "attention.head_dim",
            head_dim_default,
            kind="positive",
            nullable=nullable,
            written=True if head_dim else _head_dim_differs,
        ),
        Field("rms_norm_eps", "norm.eps", eps, kind="positive_number", read=float),
    ]
    if tie:
        fields.append(Field("tie_word_embeddings", "tie_embeddings", False, kind="bool"))
    return tuple(fields)


def expert_widths_rule(label: str) -> Rule:
    """``moe_intermediate_size`` <-> each routed expert's width and each shared expert's (DeepSeek, GLM-4.5: the
    shared experts are one SwiGLU of ``moe_intermediate_size * n_shared_experts``)."""

    def read(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        if "moe_intermediate_size" not in hf:
            raise ValueError(f"{source}: missing field 'moe_intermediate_size'")
        width = hf["moe_intermediate_size"]
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"{source}: moe_intermediate_size={show(width)} is invalid; allowed: a positive integer")
        return {"moe.expert_dim": width, "moe.shared_expert_dim": width}

    def write(config: ModelConfig) -> dict[str, Any]:
        moe = config.moe
        if moe.shared_expert_dim not in (None, moe.expert_dim):
            raise ValueError(
                f"moe.shared_expert_dim={moe.shared_expert_dim!r} has no Hugging Face {label} equivalent; allowed: "
                f"None | {moe.expert_dim}"
            )
        return {"moe_intermediate_size": moe.expert_dim}

    return Rule(("moe_intermediate_size",), ("moe.expert_dim", "moe.shared_expert_dim"), read, write)


def dense_first_rule(label: str, dense_default: int, attention: str = "gqa") -> Rule:
    """``num_hidden_layers`` + ``first_k_dense_replace`` <-> ``layers``: layer ``i`` is a dense SwiGLU iff
    ``i < first_k_dense_replace``, routed experts after (DeepSeek, GLM-4.5), every one with ``attention``."""

    def read(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        if "num_hidden_layers" not in hf:
            raise ValueError(f"{source}: missing field 'num_hidden_layers'")
        layers = _integer(hf, "num_hidden_layers", None, source)
        dense = _integer(hf, "first_k_dense_replace", dense_default, source, minimum=0)
        return {"layers": tuple(LayerKind(attention, "dense" if i < dense else "moe") for i in range(layers))}

    def write(config: ModelConfig) -> dict[str, Any]:
        kinds = config.ffn_kinds()
        dense = kinds.index("moe") if "moe" in kinds else len(kinds)
        plain = all(layer == LayerKind(attention, layer.ffn) for layer in config.layers)
        if set(kinds[dense:]) - {"moe"} or not plain:
            raise ValueError(
                f"layers={config.layers!r} has no Hugging Face {label} equivalent; allowed: {attention} attention "
                "in every layer, dense FFNs first, then moe"
            )
        return {"num_hidden_layers": len(kinds), "first_k_dense_replace": dense}

    return Rule(("num_hidden_layers", "first_k_dense_replace"), ("layers",), read, write)


def positive_shared(count: int) -> int:
    """``n_shared_experts`` as written: at least one (transformers' DeepSeek and GLM MoE blocks always hold one)."""
    if count <= 0:
        raise ValueError("allowed: a positive number")
    return count


def selection_bias_rule(label: str) -> Rule:
    """The router's ``bias_update_rate`` (how eqmoe keeps moving the aux-loss-free selection bias) may be any
    positive rate, which creates the bias ``e_score_correction_bias`` loads into; transformers holds that bias
    always and never updates it, and no key says the rate."""

    def write(config: ModelConfig) -> dict[str, Any]:
        rate = config.moe.router.bias_update_rate
        if rate <= 0:
            raise ValueError(
                f"moe.router.bias_update_rate={rate!r} has no Hugging Face {label} equivalent; allowed: a positive "
                "number"
            )
        return {}

    return Rule((), ("moe.router.bias_update_rate",), lambda hf, source: {}, write)


def on_off(on: str, off: str, key: str) -> Callable[[str], bool]:
    """The writer of a boolean key that stands for a config field's value ``on`` (true) or ``off`` (false)."""

    def write(value: str) -> bool:
        if value not in (on, off):
            raise ValueError(f"allowed: {off!r} | {on!r} ({key})")
        return value == on

    return write
