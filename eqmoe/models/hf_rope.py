"""The RoPE part of Hugging Face ``config.json`` files, as a field-map rule (:mod:`eqmoe.models.field_map`): the
``rope_parameters`` dictionary of transformers 5, or the older ``rope_scaling`` + ``rope_theta``, with partial rotation,
read and refused as transformers reads them. Errors are one line naming the key and the file."""

from collections.abc import Mapping
from typing import Any

from eqmoe.config import ModelConfig, RopeScaling
from eqmoe.models.field_map import Rule, show

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
