"""Model families: what one published architecture (Qwen3-MoE, Envy, ...) brings to the generic decoder.

A family is its presets, its Hugging Face ``config.json`` reading and writing, and its checkpoint name
map, registered by name (the Hugging Face ``model_type`` where it has one). ``ModelConfig.family`` says
which family reads and writes a config's checkpoints; :mod:`eqmoe.checkpoints.hf` dispatches through it
and knows no family by name. A new family is one file that builds a :class:`Family` and one import line in
``eqmoe/models/__init__.py``.
"""

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from eqmoe.config import LayerKind, ModelConfig, segments
from eqmoe.registries import ATTENTION_KINDS
from eqmoe.registry import Registry
from eqmoe.tensor_names import TensorName, linear_names  # noqa: F401 (the families' name-map pieces)


def layer_slots(config: ModelConfig) -> Iterator[tuple[int, int, int, int, LayerKind]]:
    """``(layer, segment, repeat, position in unit, layer kind)`` for every layer in checkpoint order."""
    layer = 0
    for s, segment in enumerate(segments(config.layers)):
        for r in range(segment.repeats):
            for u, kind in enumerate(segment.unit):
                yield layer, s, r, u, kind
                layer += 1


def outer_names(config: ModelConfig) -> list[TensorName]:
    """The embedding, final norm and (untied) output layer in the names transformers' decoders share."""
    names = [
        TensorName("model.embed_tokens.weight", ("embed",), ()),
        TensorName("model.norm.weight", ("final_norm", "weight"), ()),
    ]
    if not config.tie_embeddings:
        names.append(TensorName("lm_head.weight", ("lm_head",), (), linear_in_dims=1))
    return names


def attention_names(
    prefix: str, block: tuple, repeat: int | None, config: ModelConfig, kind: LayerKind
) -> list[TensorName]:
    """A decoder layer's two norms and its attention (``prefix``: ``model.layers.{i}.``): the norms in the names
    transformers' decoders share, the attention's tensors as its kind names them under its module's name
    (``self_attn.``, ``linear_attn.``). ``repeat``: the block's index in its stacked segment (``None``: not stacked)."""
    attention = ATTENTION_KINDS.get(kind.attention)
    index = () if repeat is None else (repeat,)
    module = prefix + attention.hf_module + "."
    return [
        TensorName(prefix + "input_layernorm.weight", (*block, "attn_norm", "weight"), index),
        TensorName(prefix + "post_attention_layernorm.weight", (*block, "pre_norm", "weight"), index),
        *attention.checkpoint_names(config, kind, module, (*block, "attention"), index),
    ]


SWIGLU_NAMES = (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))


def swiglu_names(prefix: str, path: tuple, index: tuple[int, ...]) -> list[TensorName]:
    """The gate/up/down projections of the SwiGLU at ``path`` (a dense FFN, one routed expert with its index,
    a shared expert), under ``prefix`` (``model.layers.{i}.mlp.``) in transformers' names."""
    return [TensorName(f"{prefix}{hub}.weight", (*path, leaf, "weight"), index, 1) for hub, leaf in SWIGLU_NAMES]


def _no_hf_format(name: str) -> Callable[..., Any]:
    def refuse(*_args, **_kwargs):
        raise ValueError(f"model family {name!r} has no Hugging Face checkpoint format")

    return refuse


@dataclass(frozen=True)
class Family:
    """One architecture family.

    **Arguments:**

    - ``name``: the registry key, equal to the Hugging Face ``model_type`` when the family has one.
    - ``presets``: published and CPU-sized configurations, by preset name.
    - ``config_from_hf(hf, source)``: a ``ModelConfig`` from a ``config.json`` dictionary; refuses, naming
      the field, whatever the family's checkpoints carry that eqmoe cannot reproduce exactly.
    - ``config_to_hf(config)``: the ``config.json`` dictionary; a ``ValueError`` names the first field the
      family's Hugging Face model cannot express.
    - ``checkpoint_names(config)``: every checkpoint tensor of ``config`` and where it lives in the model.
    - ``reference_columns(path, shape)``: optional extra columns of the parameter report, naming the
      parameter at ``path`` in the family's reference codebases.
    - ``skipped_keys``: regular expressions of tensors the family's published checkpoints hold beyond the
      model transformers builds (GLM-4.5's multi-token-prediction layer); a key that matches one and that the
      config does not expect is skipped when loading instead of refused.
    - ``field_map``: the family's ``config.json`` as a table (:class:`eqmoe.models.field_map.FieldMap`), from
      which ``config_from_hf`` and ``config_to_hf`` come when not given, and which says which keys transformers
      ignores (:meth:`ignored_keys`).

    A family without a Hugging Face format (``hf_model_type=None``) leaves the three functions out; they
    then refuse with a ``ValueError`` naming the family.
    """

    name: str
    presets: Mapping[str, ModelConfig]
    hf_model_type: str | None = None
    config_from_hf: Callable[[dict[str, Any], str], ModelConfig] | None = None
    config_to_hf: Callable[[ModelConfig], dict[str, Any]] | None = None
    checkpoint_names: Callable[[ModelConfig], list[TensorName]] | None = None
    reference_columns: Callable[[str, tuple[int, ...]], dict[str, str]] | None = None
    skipped_keys: tuple[str, ...] = ()
    field_map: Any = None

    def __post_init__(self):
        if self.field_map is not None:
            if self.config_from_hf is None:
                object.__setattr__(self, "config_from_hf", self.field_map.read)
            if self.config_to_hf is None:
                object.__setattr__(self, "config_to_hf", self.field_map.write)
        for name in ("config_from_hf", "config_to_hf", "checkpoint_names"):
            if getattr(self, name) is None:
                if self.hf_model_type is not None:
                    raise ValueError(f"family {self.name!r} has a Hugging Face model_type but no {name}")
                object.__setattr__(self, name, _no_hf_format(self.name))
        for preset, config in self.presets.items():
            if config.family != self.name:
                raise ValueError(f"preset {preset!r} of family {self.name!r} says family={config.family!r}")

    @property
    def hf_model_types(self) -> tuple[str, ...]:
        """Every ``model_type`` whose files this family reads (its own first)."""
        also = () if self.field_map is None else self.field_map.also_reads
        return () if self.hf_model_type is None else (self.hf_model_type, *also)

    def ignored_keys(self, hf: dict[str, Any]) -> list[str]:
        """The keys of a ``config.json`` dictionary transformers ignores for this family (none without a table)."""
        return [] if self.field_map is None else self.field_map.ignored_keys(hf)


FAMILIES: Registry[Family] = Registry("model family")


def register(family: Family) -> Family:
    """Add ``family`` to :data:`FAMILIES` (its name and its preset names must be new)."""
    taken = {preset for _, other in FAMILIES.items() for preset in other.presets}
    if clash := sorted(taken & set(family.presets)):
        raise ValueError(f"family {family.name!r}: preset {clash[0]!r} is already registered")
    return FAMILIES.register(family.name, family)


def get(name: str) -> Family:
    """The family registered as ``name``; a ``ValueError`` naming the registered ones otherwise."""
    return FAMILIES.get(name)


def from_hf_model_type(model_type: Any, source: str) -> Family:
    """The family whose checkpoints say ``"model_type": model_type`` in ``config.json``."""
    for _, family in FAMILIES.items():
        if family.hf_model_type is not None and model_type in family.hf_model_types:
            return family
    known = sorted(name for _, f in FAMILIES.items() if f.hf_model_type for name in f.hf_model_types)
    raise ValueError(f"{source}: model_type {model_type!r} is not supported; allowed: {' | '.join(known)}")


def all_presets() -> dict[str, ModelConfig]:
    return {name: config for _, family in FAMILIES.items() for name, config in family.presets.items()}
