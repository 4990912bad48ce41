"""Configs as data: dictionaries for checkpoint metadata, ``FIELD.PATH=VALUE`` overrides, and the
architecture differences a resume or ``Transformer.with_config`` refuses."""

from __future__ import annotations

import dataclasses

from eqmoe.config import (
    AttentionConfig,
    LatentAttentionConfig,
    LayerKind,
    LinearAttentionConfig,
    LossConfig,
    ModelConfig,
    MoEConfig,
    NormConfig,
    RopeScaling,
    RouterConfig,
    layer_kind,
)
from eqmoe.registries import check_names


def architecture_differences(a: object, b: object, prefix: str = "") -> list[tuple[str, object, object]]:
    """``(dotted field path, value in a, value in b)`` for every architecture field in which the configs
    ``a`` and ``b`` differ, walking nested configs; execution and objective fields are skipped.

    ``architecture_differences(config, config.replace(remat="block"))`` is ``[]``; with
    ``moe.router.num_experts`` 8 in ``a`` and 16 in ``b`` it is ``[("moe.router.num_experts", 8, 16)]``.
    """
    if not (dataclasses.is_dataclass(a) and type(a) is type(b)):
        return [] if a == b else [(prefix or "config", a, b)]
    differences = []
    for item in dataclasses.fields(a):
        if item.metadata.get("kind", "architecture") != "architecture":
            continue
        path = f"{prefix}.{item.name}" if prefix else item.name
        differences += architecture_differences(getattr(a, item.name), getattr(b, item.name), path)
    return differences


def format_differences(differences: list[tuple[str, object, object]], a: str, b: str) -> str:
    """``"moe.router.num_experts 8 (a) vs 16 (b)"``, joined by ``"; "``."""
    return "; ".join(f"{path} {x!r} ({a}) vs {y!r} ({b})" for path, x, y in differences)


def config_to_dict(config: ModelConfig) -> dict:
    """A JSON-serialisable dictionary of ``config`` (for checkpoint metadata and results files)."""
    return dataclasses.asdict(config)


def _layers_from_dict(layers: list | tuple) -> tuple[LayerKind, ...]:
    """``ModelConfig.layers`` from its dictionary form; also the scanned segments older checkpoints recorded
    (``[{"unit": ["dense", "moe"], "repeats": 6}]``), which are the same layers written per repeat unit."""
    kinds = []
    for entry in layers:
        if isinstance(entry, dict) and set(entry) == {"unit", "repeats"}:
            unit, repeats = entry["unit"], entry["repeats"]
            if not unit or not isinstance(repeats, int) or repeats < 1:
                raise ValueError(f"layers entry {entry!r} is invalid; allowed: a non-empty unit repeated at least once")
            kinds += [layer_kind(kind) for _ in range(repeats) for kind in unit]
        else:
            kinds.append(layer_kind(entry))
    return tuple(kinds)


def config_from_dict(values: dict) -> ModelConfig:
    """The inverse of :func:`config_to_dict`; unknown or missing fields raise ``ValueError``."""
    try:
        values = dict(values)
        moe = values.pop("moe", None)
        if moe is not None:
            if isinstance(moe.get("tiles"), list):  # JSON keeps a tuple as a list
                moe = {**moe, "tiles": tuple(moe["tiles"])}
            moe = MoEConfig(**{**moe, "router": RouterConfig(**moe["router"])})
        attention = dict(values.pop("attention"))
        if isinstance(attention.get("rope_scaling"), dict):
            attention["rope_scaling"] = RopeScaling(**attention["rope_scaling"])
        if isinstance(attention.get("latent"), dict):
            attention["latent"] = LatentAttentionConfig(**attention["latent"])
        if isinstance(attention.get("linear"), dict):
            attention["linear"] = LinearAttentionConfig(**attention["linear"])
        return ModelConfig(
            **{
                **values,
                "attention": AttentionConfig(**attention),
                "norm": NormConfig(**values.pop("norm", {})),
                "loss": LossConfig(**values.pop("loss", {})),
                "layers": _layers_from_dict(values.pop("layers")),
                "moe": moe,
            }
        )
    except (KeyError, TypeError) as error:
        raise ValueError(f"not a ModelConfig dictionary: {error}") from None


def _typed(path: str, value: object, expected: object, is_bearable) -> object:
    """``value`` if it is an ``expected``, an integer as a float where a float is expected; else a ``ValueError``."""
    if isinstance(value, int) and not isinstance(value, bool) and not is_bearable(value, expected):
        value = float(value)
    if not is_bearable(value, expected):
        raise ValueError(f"override {path}={value!r}: not a valid {expected}")
    return value


def apply_overrides(config: ModelConfig, overrides: dict[str, object]) -> ModelConfig:
    """``config`` with dotted fields replaced, e.g. ``{"moe.router.top_k": 1, "norm.ffn_placement": "post"}``.

    Each value is checked against its field's type (JSON lists become tuples, integers are accepted for
    floats; ``layers`` takes a list of FFN kind names or of :class:`~eqmoe.config.LayerKind` objects); then the
    new config is validated as a whole, every registered name it uses included
    (:func:`eqmoe.registries.check_names`), so the order of the overrides never matters. A ``ValueError`` names
    the override at fault.
    """
    import typing

    from beartype.door import is_bearable

    values = config_to_dict(config)
    at_fault = {}  # the validation message an override's own value would get -> the override
    for path, value in overrides.items():
        owner, parent, names = config, values, path.split(".")
        for depth, name in enumerate(names):
            if not dataclasses.is_dataclass(owner):
                raise ValueError(f"override {path!r}: {'.'.join(names[:depth])} is not a config ({owner!r})")
            fields = sorted(f.name for f in dataclasses.fields(owner))
            if name not in fields:
                raise ValueError(
                    f"override {path!r}: {type(owner).__name__} has no field {name!r}; fields: {', '.join(fields)}"
                )
            if depth < len(names) - 1:
                owner, parent = getattr(owner, name), parent[name]
        expected = typing.get_type_hints(type(owner))[names[-1]]
        value = tuple(value) if isinstance(value, list) else value
        if path == "layers":  # a JSON list of layer kinds: FFN kind names or objects of LayerKind's fields
            try:
                parent["layers"] = [dataclasses.asdict(layer_kind(item)) for item in value]
            except (ValueError, TypeError) as error:
                raise ValueError(f"override layers={value!r}: {error}") from None
            at_fault["layers["] = at_fault["LayerKind."] = f"layers={value!r}"
            continue
        nested = [t for t in (expected, *typing.get_args(expected)) if dataclasses.is_dataclass(t)]
        if isinstance(value, dict) and nested:  # a JSON object for a nested config, e.g. attention.rope_scaling
            kind = nested[0]
            hints, fields = typing.get_type_hints(kind), sorted(f.name for f in dataclasses.fields(kind))
            converted = {}
            for key, item in value.items():
                if key not in fields:
                    raise ValueError(
                        f"override {path}: {kind.__name__} has no field {key!r}; fields: {', '.join(fields)}"
                    )
                converted[key] = _typed(f"{path}.{key}", item, hints[key], is_bearable)
            parent[names[-1]] = converted
            at_fault[f"{kind.__name__}."] = f"{path}={value!r}"
            continue
        value = _typed(path, value, expected, is_bearable)
        parent[names[-1]] = value
        at_fault[f"{type(owner).__name__}.{names[-1]}={value!r} is invalid"] = f"{path}={value!r}"
    try:
        config = config_from_dict(values)
        check_names(config)
        return config
    except ValueError as error:
        named = [override for message, override in at_fault.items() if message in str(error)]
        where = f"override {named[0]}" if len(named) == 1 else f"overrides {overrides!r}"
        raise ValueError(f"{where}: {error}") from None


def parse_override(text: str) -> tuple[str, object]:
    """``"moe.router.top_k=1"`` -> ``("moe.router.top_k", 1)``: the value is JSON when it parses as JSON
    (numbers, ``true``, ``null``, lists, quoted strings) and the bare text otherwise."""
    import json

    path, equals, raw = text.partition("=")
    if not equals or not path.strip():
        raise ValueError(f"override {text!r} is invalid; allowed: FIELD.PATH=VALUE, e.g. moe.router.top_k=1")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return path.strip(), value


def format_override(path: str, value: object) -> str:
    """The ``FIELD.PATH=VALUE`` text that :func:`parse_override` reads back as ``(path, value)``."""
    import json

    text = json.dumps(value)
    if isinstance(value, str):
        try:
            json.loads(value)
        except json.JSONDecodeError:
            text = value  # reads back as itself: no quotes needed
    return f"{path}={text}"
