"""A family's Hugging Face ``config.json`` as one declarative table, from which its reader, its writer and its
allow-list are generated.

Each entry says how ``config.json`` keys and ``ModelConfig`` fields correspond:

- :class:`Field`: one key <-> one config field (its default when absent, what values it takes, a conversion each
  way, the aliases transformers' ``attribute_map`` accepts);
- :class:`Fixed`: a key transformers reads that eqmoe computes only at one value (``hidden_act: "silu"``);
- :class:`Known`: keys transformers reads that change nothing eqmoe computes (token ids, output switches);
- :class:`Rule`: several keys <-> several fields, in code (the RoPE dictionary, the dense/MoE layer layout).

Reading follows transformers: a key the family's config reads is reproduced or refused in one line naming it;
every other key (transformers ignores it too, e.g. Qwen3-Coder's ``qkv_bias``) is accepted and listed, once, on
an "ignored" line. Writing refuses, naming the field, every architecture field the table does not write and that
differs from the family's template (its constant choices), so a decoder field added later is never exported
silently wrong.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from eqmoe.config import ModelConfig, field_kind
from eqmoe.config_io import config_from_dict, config_to_dict

REQUIRED = object()  # a Field's default: the key must be present


def show(value: object) -> str:
    """``value`` as config.json writes it (``true``, ``null``, ``"gelu"``)."""
    return json.dumps(value, default=repr)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# What a Field's value may be: name -> (test, what the error says is allowed).
KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "positive": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "count": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "bool": (lambda v: isinstance(v, bool), "true | false"),
    "number": (_is_number, "a number"),
    "positive_number": (lambda v: _is_number(v) and v > 0, "a positive number"),
    "indices": (lambda v: isinstance(v, list) and all(_is_int(i) for i in v), "a list of layer indices"),
    "any": (lambda v: True, "anything"),
}


@dataclass(frozen=True)
class Field:
    """``config.json``'s ``key`` is the config field at ``path`` (dotted, ``"moe.router.top_k"``).

    ``default``: the value transformers uses when the key is absent (or null, with ``nullable``): a constant, a
    function of the whole ``config.json`` dictionary, or :data:`REQUIRED`. ``kind`` checks the value
    (:data:`KINDS`); ``read``/``write`` convert it each way (``write`` raises ``ValueError`` for a value the
    format cannot hold). ``aliases`` are other keys transformers reads as this one. ``written``: whether an
    export writes it (``False``: never, transformers derives it; a function of the config: only when it says so).
    """

    key: str
    path: str
    default: Any = REQUIRED
    kind: str = "any"
    read: Callable[[Any], Any] | None = None
    write: Callable[[Any], Any] | None = None
    aliases: tuple[str, ...] = ()
    nullable: bool = False
    written: bool | Callable[[ModelConfig], bool] = True

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key, *self.aliases)

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.path,)


@dataclass(frozen=True)
class Fixed:
    """``key`` is read by transformers and computed by eqmoe only at ``value`` (its default there); another value
    is refused. ``written``: whether an export writes it."""

    key: str
    value: Any
    written: bool = True

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key,)

    paths: tuple[str, ...] = ()


@dataclass(frozen=True)
class Known:
    """Keys transformers reads that change nothing eqmoe computes from the weights (never written)."""

    keys: tuple[str, ...]
    paths: tuple[str, ...] = ()


@dataclass(frozen=True)
class Rule:
    """``keys`` <-> the config fields at ``paths``, in code: ``read(hf, source) -> {path: value}`` (refusing in one
    line what it cannot reproduce) and ``write(config) -> {key: value}`` (raising ``ValueError`` naming the field
    for what the format cannot hold)."""

    keys: tuple[str, ...]
    paths: tuple[str, ...]
    read: Callable[[Mapping[str, Any], str], dict[str, Any]]
    write: Callable[[ModelConfig], dict[str, Any]]
    ignored: Callable[[Mapping[str, Any]], list[str]] | None = None  # nested keys transformers ignores


# Written by PreTrainedConfig for every model type, or read by it; none changes what eqmoe computes.
COMMON_KNOWN = Known(
    (
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
        # how the weights are stored, not what they compute: eqmoe.checkpoints.hf dequantizes what it can read
        # and refuses the rest
        "quantization_config",
    )
)
COMMON_FIXED = (Fixed("chunk_size_feed_forward", 0, written=False), Fixed("is_encoder_decoder", False, written=False))

# Architecture fields no config.json holds and none needs to: how parameters are drawn and stored (the export's
# ``dtype``), and which family reads the folder.
# ``moe.router.num_groups`` splits tokens for capacity routing only, which no Hugging Face family has.
FREE_FIELDS = ("init", "init_std", "param_dtype", "family", "moe.router.num_groups")

Entry = Field | Fixed | Known | Rule


def _get(tree: dict, path: str) -> Any:
    for name in path.split("."):
        tree = tree[name]
    return tree


def _set(tree: dict, path: str, value: Any) -> None:
    *parents, name = path.split(".")
    for parent in parents:
        tree = tree[parent]
    tree[name] = value


def _config_value(config: ModelConfig, path: str) -> Any:
    value = config
    for name in path.split("."):
        value = getattr(value, name)
    return value


def _owner_names(template: ModelConfig, path: str) -> str:
    """``"RouterConfig.top_k"`` for ``"moe.router.top_k"``: how a config error names the field at ``path``."""
    *parents, name = path.split(".")
    owner = template
    for parent in parents:
        owner = getattr(owner, parent)
    return f"{type(owner).__name__}.{name}"


@dataclass(frozen=True)
class FieldMap:
    """One family's ``config.json``: ``template`` holds its constant choices (and placeholder sizes every file
    overrides); ``entries`` say how each key reads and writes; ``label`` names the format in errors."""

    model_type: str
    architecture: str
    label: str
    template: ModelConfig
    entries: tuple[Entry, ...]
    free: tuple[str, ...] = ()  # architecture fields the format leaves to eqmoe (any value exports)
    # other model_type values whose files are this format (Kimi K2's "kimi_k2" names DeepseekV3ForCausalLM);
    # exports write ``model_type``
    also_reads: tuple[str, ...] = ()

    @property
    def model_types(self) -> tuple[str, ...]:
        return (self.model_type, *self.also_reads)

    def __post_init__(self):
        seen: dict[str, Entry] = {}
        for entry in (*self.entries, COMMON_KNOWN, *COMMON_FIXED):
            for key in entry.keys:
                if key in seen and seen[key] is not entry:
                    raise ValueError(f"FieldMap {self.model_type}: key {key!r} has two entries")
                seen[key] = entry

    @property
    def _all(self) -> tuple[Entry, ...]:
        fixed_keys = {entry.key for entry in self.entries if isinstance(entry, Fixed)}
        common = tuple(entry for entry in COMMON_FIXED if entry.key not in fixed_keys)
        return (*self.entries, COMMON_KNOWN, *common)

    def known_keys(self) -> set[str]:
        """Every key this family's transformers config reads (the allow-list)."""
        return {key for entry in self._all for key in entry.keys}

    def ignored_keys(self, hf: Mapping[str, Any]) -> list[str]:
        """The keys of ``hf`` transformers ignores for this model type (accepted, listed), nested ones as
        ``parent.key``."""
        nested = [
            key for entry in self.entries if isinstance(entry, Rule) and entry.ignored for key in entry.ignored(hf)
        ]
        return sorted(key for key in hf if key not in self.known_keys()) + nested

    # --- reading -------------------------------------------------------------------------------------------

    def read(self, hf: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        """The :class:`ModelConfig` of a ``config.json`` dictionary of this family, or a one-line ``ValueError``
        naming ``source`` and the key at fault. Keys transformers ignores are accepted (:meth:`ignored_keys`)."""
        if hf.get("model_type") not in self.model_types:
            allowed = " | ".join(repr(name) for name in self.model_types)
            raise ValueError(f"{source}: model_type {hf.get('model_type')!r} is not supported; allowed: {allowed}")
        values = config_to_dict(self.template)
        for entry in self._all:
            if isinstance(entry, Fixed):
                value = hf.get(entry.key, entry.value)
                if value != entry.value or isinstance(value, bool) != isinstance(entry.value, bool):
                    raise ValueError(
                        f"{source}: {entry.key}={show(value)} is not supported; allowed: {show(entry.value)}"
                    )
            elif isinstance(entry, Field):
                _set(values, entry.path, self._read_field(entry, hf, source))
            elif isinstance(entry, Rule):
                for path, value in entry.read(hf, source).items():
                    _set(values, path, value)
        try:
            return config_from_dict(values)
        except (TypeError, ValueError) as error:
            message = str(error).removeprefix("not a ModelConfig dictionary: ")
            for entry in self.entries:  # name the config.json key, not eqmoe's field
                if isinstance(entry, Field):
                    message = message.replace(_owner_names(self.template, entry.path) + "=", entry.key + "=")
            raise ValueError(f"{source}: {message}") from None

    def _read_field(self, field: Field, hf: Mapping[str, Any], source: str) -> Any:
        present = [key for key in field.keys if key in hf and not (field.nullable and hf[key] is None)]
        if present:
            key, value = present[0], hf[present[0]]
        elif field.default is REQUIRED:
            raise ValueError(f"{source}: missing field {field.key!r}")
        else:
            key, value = field.key, field.default(hf) if callable(field.default) else field.default
            if value is None:  # absent, and transformers' default is None too
                return None
        test, allowed = KINDS[field.kind]
        if not test(value):
            raise ValueError(f"{source}: {key}={show(value)} is invalid; allowed: {allowed}")
        try:
            return field.read(value) if field.read is not None else value
        except ValueError as error:
            raise ValueError(f"{source}: {key}={show(value)} is not supported; {error}") from None

    # --- writing -------------------------------------------------------------------------------------------

    def write(self, config: ModelConfig) -> dict[str, Any]:
        """The ``config.json`` dictionary of ``config``; a ``ValueError`` names the first field the family's format
        cannot express: first those the table writes (a value it has no key for), then the rest (any value but the
        template's)."""
        hf: dict[str, Any] = {"architectures": [self.architecture], "model_type": self.model_type}
        for entry in self._all:
            if isinstance(entry, Fixed) and entry.written:
                hf[entry.key] = entry.value
            elif isinstance(entry, Field) and (entry.written(config) if callable(entry.written) else entry.written):
                value = _config_value(config, entry.path)
                if value is None and entry.default is None:
                    continue  # left out, as transformers' default
                try:
                    hf[entry.key] = entry.write(value) if entry.write is not None else value
                except ValueError as error:
                    raise ValueError(
                        f"{entry.path}={value!r} has no Hugging Face {self.label} equivalent; {error}"
                    ) from None
            elif isinstance(entry, Rule):
                hf.update(entry.write(config))
        self.check_expressible(config)
        hf["dtype"] = config.param_dtype
        return hf

    def check_expressible(self, config: ModelConfig) -> None:
        """Refuse, naming the first field, an architecture field the table does not write whose value differs
        from the template's: the family's format has no key for it."""
        written = {path for entry in self.entries for path in entry.paths} | set(FREE_FIELDS) | set(self.free)
        template = self.template
        for path, value in _architecture_values(config).items():
            if any(path == p or path.startswith(p + ".") for p in written):
                continue
            expected = _config_value(template, path)
            if value != expected:
                raise ValueError(f"{path}={value!r} has no Hugging Face {self.label} equivalent; allowed: {expected!r}")


def _architecture_values(config: object, prefix: str = "") -> dict[str, Any]:
    """``{dotted path: value}`` of every architecture field of ``config`` (nested configs walked into;
    ``rope_scaling`` and ``layers`` kept whole)."""
    fields = {}
    for item in dataclasses.fields(config):
        if field_kind(config, item.name) != "architecture":
            continue
        value, path = getattr(config, item.name), prefix + item.name
        if dataclasses.is_dataclass(value) and item.name != "rope_scaling":
            fields.update(_architecture_values(value, path + "."))
        else:
            fields[path] = value
    return fields


def report_ignored(keys: list[str], source: str, model_type: str) -> None:
    """One line on stderr listing the keys of ``source`` transformers ignores for ``model_type`` (none: nothing)."""
    if keys:
        print(
            f"{source}: ignored (transformers does not read them for {model_type}): {', '.join(keys)}", file=sys.stderr
        )
