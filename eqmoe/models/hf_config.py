"""Family-independent parts of reading and writing Hugging Face ``config.json`` files.

Every family refuses what eqmoe cannot reproduce exactly, so each carries an allow-list (:class:`FieldList`:
fields it reads, fields that change nothing eqmoe computes, fields fixed at one value) checked by
:func:`check_fields`; and every family with RoPE reads ``rope_parameters`` (transformers 5) or the older
``rope_scaling`` + ``rope_theta`` the same way (:func:`rope_from_hf`, :func:`rope_to_hf`). Errors are one line
naming the field and the file, so a refused checkpoint says what to change.
"""

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from eqmoe.config import ModelConfig, RopeScaling, field_kind

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

# Written by PreTrainedConfig for every model type; none changes what eqmoe computes from the weights.
COMMON_IRRELEVANT_FIELDS = (
    "architectures",
    "model_type",
    "transformers_version",
    "_name_or_path",
    "_attn_implementation_autoset",
    "dtype",
    "torch_dtype",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "output_router_logits",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "id2label",
    "label2id",
    "problem_type",
)


@dataclass(frozen=True)
class FieldList:
    """One family's allow-list of ``config.json`` fields.

    ``read``: fields that set the ``ModelConfig``; ``irrelevant``: metadata, token ids and output switches;
    ``fixed``: fields eqmoe computes only at the value shown (transformers' default); any other field is
    refused, so a checkpoint whose config asks for something eqmoe does not compute never loads silently wrong.
    """

    read: tuple[str, ...]
    irrelevant: tuple[str, ...]
    fixed: Mapping[str, Any] = field(default_factory=dict)

    def known(self) -> set[str]:
        return {*self.read, *self.irrelevant, *self.fixed}


ANY = None  # in an ``expressible`` map: every value of the field is written to config.json

# Architecture fields every Hugging Face decoder family writes whatever their value (widths, depth, vocabulary,
# RoPE base and scaling, norm epsilon, the layer layout each family checks itself), and fields that change no
# computed value: the initialisation, the storage dtype (the export's ``dtype``), the token groups of capacity
# routing (without capacity, which every family refuses, they change nothing).
WRITTEN_BY_EVERY_FAMILY = (
    "vocab_size",
    "embed_dim",
    "mlp_dim",
    "layers",
    "tie_embeddings",
    "init",
    "init_std",
    "param_dtype",
    "family",
    "attention.num_heads",
    "attention.num_kv_heads",
    "attention.head_dim",
    "attention.rope_theta",
    "attention.rope_scaling",
    "norm.eps",
    "moe.expert_dim",
    "moe.router.num_experts",
    "moe.router.top_k",
    "moe.router.num_groups",
)


def _architecture_fields(config: object, prefix: str = "") -> dict[str, tuple[object, dataclasses.Field]]:
    """``{dotted path: (value, field)}`` of every architecture field of ``config``, nested configs walked into
    (``rope_scaling`` kept whole: the families write it as one dictionary)."""
    fields = {}
    for item in dataclasses.fields(config):
        if field_kind(config, item.name) != "architecture":
            continue
        value, path = getattr(config, item.name), prefix + item.name
        if dataclasses.is_dataclass(value) and item.name != "rope_scaling":
            fields.update(_architecture_fields(value, path + "."))
        else:
            fields[path] = (value, item)
    return fields


def check_expressible(config: ModelConfig, label: str, expressible: Mapping[str, tuple | None]) -> None:
    """Refuse, naming the first field, what a family's ``config.json`` cannot express: a field in ``expressible``
    must hold one of its values (:data:`ANY`: any value), one in :data:`WRITTEN_BY_EVERY_FAMILY` may hold any,
    and every other architecture field its default, the generic decoder's plain choice. So a field added to the
    decoder later is refused by every family that has not said how it writes it, never exported silently wrong.
    """
    for path, (value, item) in _architecture_fields(config).items():
        if path in expressible:
            allowed = expressible[path]
        elif path in WRITTEN_BY_EVERY_FAMILY:
            allowed = ANY
        else:
            allowed = (item.default,)
        if allowed is not ANY and value not in allowed:
            choices = " | ".join(map(repr, allowed))
            raise ValueError(f"{path}={value!r} has no Hugging Face {label} equivalent; allowed: {choices}")


def show(value: object) -> str:
    """``value`` as config.json writes it (``true``, ``null``, ``"gelu"``)."""
    return json.dumps(value, default=repr)


def require(hf: dict[str, Any], name: str, source: str) -> Any:
    """``hf[name]``; a one-line error naming the field and ``source`` when it is missing."""
    if name not in hf:
        raise ValueError(f"{source}: missing field {name!r}")
    return hf[name]


def check_fields(hf: dict[str, Any], source: str, fields: FieldList) -> None:
    """Refuse, naming the field and ``source``, any field outside ``fields`` and any fixed field whose value
    eqmoe does not compute (``use_sliding_window: true``, ``attention_bias: true``, dropout, ...)."""
    known = fields.known()
    for name in hf:
        if name not in known:
            raise ValueError(f"{source}: unknown field {name!r} (not one eqmoe reproduces or knows to be irrelevant)")
    for name, allowed in fields.fixed.items():
        value = hf.get(name, allowed)
        if value != allowed or isinstance(value, bool) != isinstance(allowed, bool):
            raise ValueError(f"{source}: {name}={show(value)} is not supported; allowed: {show(allowed)}")


def positive_integers(values: Mapping[str, Any], source: str) -> None:
    """Refuse, naming the field, any value that is not a positive integer (booleans included)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{source}: {name}={value!r} is invalid; allowed: a positive integer")


def _rope_dict(hf: dict[str, Any], source: str) -> tuple[str, dict[str, Any]]:
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
    hf: dict[str, Any], source: str, default_max_positions: int, partial_rotary: bool = False
) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from a Hugging Face config: ``rope_parameters`` (transformers 5), or the
    older ``rope_scaling`` (``type`` or ``rope_type``) with a top-level ``rope_theta``.

    As transformers reads them: ``rope_theta`` inside the dictionary wins, then the top-level one, then
    10000; ``yarn`` and ``llama3`` without ``original_max_position_embeddings`` use ``max_position_embeddings``
    (the family config's default, ``default_max_positions``, when absent). A key the rope type does not read,
    or a type eqmoe does not compute, is refused; so is a ``partial_rotary_factor`` other than 1 unless the
    family rotates part of each head (``partial_rotary``: its reader calls :func:`rotary_dim_from_hf`).
    """
    name, params = _rope_dict(hf, source)
    where = f"{source}: {name}"
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str) or rope_type not in ROPE_KEYS:
        allowed = " | ".join(ROPE_KEYS)
        raise ValueError(f"{where}: rope_type {rope_type!r} is not supported; allowed: {allowed}")
    params = {**params, "rope_type": rope_type}
    keys = ROPE_KEYS[rope_type]
    for key in params:
        if key not in (*keys, "rope_type", "type", "rope_theta", "partial_rotary_factor"):
            raise ValueError(
                f"{where}.{key} is not read by rope_type {rope_type!r} (transformers ignores it); remove it"
            )
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


def rotary_dim_from_hf(hf: dict[str, Any], source: str, head_dim: int, default_factor: float = 1.0) -> int | None:
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
