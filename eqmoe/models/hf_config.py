"""The parts of Hugging Face ``config.json`` files several families share, as field-map pieces
(:mod:`eqmoe.models.field_map`): the RoPE dictionary (``rope_parameters`` of transformers 5, or the older
``rope_scaling`` + ``rope_theta``, with partial rotation), the dense/MoE layer layout of Qwen-style files, the
widths every decoder has. Errors are one line naming the key and the file, so a refused checkpoint says what to
change.
"""

from collections.abc import Callable, Mapping
from typing import Any

from eqmoe.config import LayerKind, ModelConfig, RopeScaling
from eqmoe.models.field_map import Field, Rule, show

# What each rope_type's parameters may hold besides rope_type, rope_theta and partial_rotary_factor:
# key -> (kind, required, nullable), as transformers reads them. A required key's absence is a KeyError in
# transformers' validation (``original_max_position_embeddings`` is filled in before it, from
# ``max_position_embeddings``); a nullable key's null means what its absence means.
ROPE_KEYS: dict[str, dict[str, tuple[str, bool, bool]]] = {
    "default": {},
    "linear": {"factor": ("number", True, False)},
    "yarn": {
        "factor": ("number", True, True),  # null: max_position_embeddings / original_max_position_embeddings
        "original_max_position_embeddings": ("integer", False, False),
        "attention_factor": ("number", False, True),
        "beta_fast": ("number", False, True),
        "beta_slow": ("number", False, True),
        "mscale": ("number", False, True),
        "mscale_all_dim": ("number", False, True),
        "truncate": ("bool", False, False),  # transformers reads a null truncate as false, absent as true
    },
    "llama3": {
        "factor": ("number", True, False),
        "original_max_position_embeddings": ("integer", False, False),
        "low_freq_factor": ("number", True, False),
        "high_freq_factor": ("number", True, False),
    },
}
KINDS = {
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
}


def _rope_dict(hf: Mapping[str, Any], source: str) -> tuple[str, dict[str, Any]]:
    """The field holding the RoPE parameters and its dictionary: ``rope_scaling`` wins over ``rope_parameters``
    when both are set, as in transformers' ``convert_rope_params_to_dict``."""
    name = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(name) or {}
    if not isinstance(params, dict):
        raise ValueError(f"{source}: {name}={params!r} is invalid; allowed: a JSON object")
    return name, params


def _rope_value(params: dict[str, Any], key: str, spec: tuple[str, bool, bool], where: str) -> Any:
    """The value of ``key`` (``None`` when absent, or null where null means absent), checked against its kind."""
    kind, required, nullable = spec
    if key not in params:
        if required:
            raise ValueError(f"{where}: missing {key!r} (rope_type {params.get('rope_type')!r} needs it)")
        return None
    value = params[key]
    if value is None and nullable:
        return None
    if not KINDS[kind](value):
        allowed = f"a {kind}" + (" or null" if nullable else "")
        raise ValueError(f"{where}.{key}={show(value)} is invalid; allowed: {allowed}")
    return float(value) if kind == "number" else value


def rope_from_hf(
    hf: Mapping[str, Any], source: str, default_max_positions: int, partial_rotary: bool = False
) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from a Hugging Face config: ``rope_parameters`` (transformers 5), or the
    older ``rope_scaling`` (``type`` or ``rope_type``) with a top-level ``rope_theta``.

    As transformers reads them: ``rope_theta`` inside the dictionary wins, then the top-level one, then
    10000; ``yarn`` and ``llama3`` without ``original_max_position_embeddings`` use ``max_position_embeddings``
    (the family config's default, ``default_max_positions``, when absent). A type eqmoe does not compute is
    refused; so is a ``partial_rotary_factor`` other than 1 unless the family rotates part of each head
    (``partial_rotary``: its reader calls :func:`rotary_dim_from_hf`). A key the rope type does not read is
    ignored, as transformers ignores it (:func:`ignored_rope_keys` lists them).
    """
    name, params = _rope_dict(hf, source)
    where = f"{source}: {name}"
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str) or rope_type not in ROPE_KEYS:
        allowed = " | ".join(ROPE_KEYS)
        raise ValueError(f"{where}: rope_type {rope_type!r} is not supported; allowed: {allowed}")
    params = {**params, "rope_type": rope_type}
    keys = ROPE_KEYS[rope_type]
    rotary = params.get("partial_rotary_factor", 1.0)
    if not partial_rotary and (not KINDS["number"](rotary) or rotary != 1.0):
        raise ValueError(f"{where}.partial_rotary_factor={show(rotary)} is not supported; allowed: 1.0")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if not KINDS["number"](theta) or theta <= 0:
        raise ValueError(f"{source}: rope_theta={show(theta)} is invalid; allowed: a positive number")
    if rope_type == "default":
        return float(theta), None
    values = {key: _rope_value(params, key, spec, where) for key, spec in keys.items()}
    max_positions = hf.get("max_position_embeddings") or default_max_positions
    if "original_max_position_embeddings" in values and values["original_max_position_embeddings"] is None:
        values["original_max_position_embeddings"] = max_positions
    try:
        return float(theta), RopeScaling(rope_type=rope_type, max_position_embeddings=max_positions, **values)
    except (TypeError, ValueError) as error:  # the dataclass names its fields as the dictionary does
        raise ValueError(f"{source}: {str(error).replace('RopeScaling.', f'{name}.')}") from None


def ignored_rope_keys(hf: Mapping[str, Any]) -> list[str]:
    """The keys of the RoPE dictionary its ``rope_type`` does not read (``rope_parameters.beta_fast`` of a
    ``linear`` one): transformers ignores them, and so does eqmoe."""
    try:
        name, params = _rope_dict(hf, "")
    except ValueError:
        return []
    keys = ROPE_KEYS.get(params.get("rope_type", params.get("type", "default")))
    if keys is None:
        return []
    read = (*keys, "rope_type", "type", "rope_theta", "partial_rotary_factor")
    return [f"{name}.{key}" for key in params if key not in read]


def rotary_dim_from_hf(hf: Mapping[str, Any], source: str, head_dim: int, default_factor: float = 1.0) -> int | None:
    """The rotated dimensions of each head, ``int(head_dim * partial_rotary_factor)`` as transformers computes
    them (``None`` when the whole head rotates). The factor is read from the RoPE dictionary, else the top level
    (older configs), else ``default_factor`` (the family config's default)."""
    _, params = _rope_dict(hf, source)
    name = "partial_rotary_factor"
    factor = params.get(name, hf.get(name, default_factor))
    if not KINDS["number"](factor) or not 0 < factor <= 1:
        raise ValueError(f"{source}: {name}={show(factor)} is invalid; allowed: a number in (0, 1]")
    rotary = int(head_dim * factor)
    if rotary < 2 or rotary % 2:
        raise ValueError(
            f"{source}: {name}={show(factor)} rotates {rotary} of head_dim={head_dim} dimensions; allowed: an even "
            "number of at least 2"
        )
    return None if rotary == head_dim else rotary


def rope_to_hf(theta: float, scaling: RopeScaling | None, partial_rotary_factor: float | None = None) -> dict[str, Any]:
    """``rope_parameters`` for ``(rope_theta, rope_scaling)``: the keys :func:`rope_from_hf` read, the ones
    left out there left out again (``factor`` is always written: transformers needs the key);
    ``partial_rotary_factor`` when given."""
    params = {"rope_type": "default" if scaling is None else scaling.rope_type, "rope_theta": theta}
    if partial_rotary_factor is not None:
        params["partial_rotary_factor"] = partial_rotary_factor
    if scaling is not None:
        for key in ROPE_KEYS[scaling.rope_type]:
            value = getattr(scaling, key)
            if value is not None or key == "factor":
                params[key] = value
    return params


def _partial_rotary_factor(head_dim: int, rotary_dim: int | None, label: str) -> float:
    """The factor transformers turns back into ``rotary_dim`` (``int(head_dim * factor)``)."""
    if rotary_dim is None:
        return 1.0
    factor = rotary_dim / head_dim
    if int(head_dim * factor) != rotary_dim:  # float rounding: e.g. int(44 * (30 / 44)) == 29
        raise ValueError(
            f"attention.rotary_dim={rotary_dim} has no Hugging Face {label} equivalent with head_dim={head_dim} "
            f"(int(head_dim * {factor!r}) is {int(head_dim * factor)}); allowed: a width the factor reproduces"
        )
    return factor


def head_dim_of(hf: Mapping[str, Any]) -> Any:
    """``head_dim`` as transformers' attention reads it: the key, else ``hidden_size // num_attention_heads``."""
    if hf.get("head_dim") is not None:
        return hf["head_dim"]
    hidden, heads = hf.get("hidden_size"), hf.get("num_attention_heads")
    valid = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hidden, heads))
    return hidden // heads if valid else None


def rope_rule(default_max_positions: int, label: str, partial_default: float | None = None) -> Rule:
    """``rope_parameters`` / ``rope_scaling`` / ``rope_theta`` / ``max_position_embeddings`` (and the top-level
    ``partial_rotary_factor``) <-> ``attention.rope_theta`` and ``attention.rope_scaling`` (:func:`rope_from_hf`,
    :func:`rope_to_hf`). With ``partial_default`` the family rotates part of each head (``attention.rotary_dim``,
    that factor when the file names none); without, any factor but 1 is refused."""
    partial = partial_default is not None

    def read(hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        theta, scaling = rope_from_hf(hf, source, default_max_positions, partial_rotary=partial)
        values = {"attention.rope_theta": theta, "attention.rope_scaling": scaling}
        if partial:
            head_dim = head_dim_of(hf)
            if head_dim is not None:
                values["attention.rotary_dim"] = rotary_dim_from_hf(hf, source, head_dim, partial_default)
        elif hf.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                f"{source}: partial_rotary_factor={show(hf['partial_rotary_factor'])} is not supported; allowed: 1.0"
            )
        return values

    def write(config: ModelConfig) -> dict[str, Any]:
        attention = config.attention
        factor = _partial_rotary_factor(attention.head_dim, attention.rotary_dim, label) if partial else None
        max_positions = attention.rope_scaling.max_position_embeddings if attention.rope_scaling else None
        return {
            "rope_parameters": rope_to_hf(attention.rope_theta, attention.rope_scaling, partial_rotary_factor=factor),
            "max_position_embeddings": max_positions or default_max_positions,
        }

    paths = ("attention.rope_theta", "attention.rope_scaling", *(("attention.rotary_dim",) if partial else ()))
    keys = ("rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings", "partial_rotary_factor")
    return Rule(keys, paths, read, write, ignored=ignored_rope_keys)


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
