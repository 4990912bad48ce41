"""Model families: what one published architecture (Qwen3-MoE, Envy, ...) brings to the generic decoder.

A family is its presets, its Hugging Face ``config.json`` reading and writing, and its checkpoint name
map, registered by name (the Hugging Face ``model_type`` where it has one). ``ModelConfig.family`` says
which family reads and writes a config's checkpoints; :mod:`eqmoe.checkpoints.hf` dispatches through it
and knows no family by name. A new family is one file that builds a :class:`Family` and one import line in
``eqmoe/models/__init__.py``.
"""

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from eqmoe.config import AttentionConfig, ModelConfig
from eqmoe.registry import Registry


@dataclass(frozen=True)
class TensorName:
    """Where one checkpoint tensor lives in the eqmoe model.

    ``path`` names a leaf of the model (attribute names and tuple indices); ``index`` selects the slice
    of that leaf (repeat index, then expert index for stacked experts). ``linear_in_dims`` > 0 marks a
    torch ``[out, in]`` matrix: our slice has ``in`` dims first, so the tensor is transposed and reshaped.
    ``flat`` marks a vector the model holds with more axes (a ``[heads, head_dim]`` bias of a flat
    ``[heads * head_dim]`` projection).
    """

    key: str
    path: tuple[str | int, ...]
    index: tuple[int, ...]
    linear_in_dims: int = 0
    flat: bool = False

    def checkpoint_shape(self, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The tensor's shape in the checkpoint (torch ``[out, in]`` for linear weights)."""
        piece = leaf_shape[len(self.index) :]
        if self.flat:
            return (math.prod(piece),)
        if self.linear_in_dims:
            return (math.prod(piece[self.linear_in_dims :]), math.prod(piece[: self.linear_in_dims]))
        return piece


def layer_slots(config: ModelConfig) -> Iterator[tuple[int, int, int, int, str]]:
    """``(layer, segment, repeat, position in unit, kind)`` for every layer in checkpoint order."""
    layer = 0
    for s, segment in enumerate(config.layers):
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


def attention_names(prefix: str, block: tuple, repeat: int, attention: AttentionConfig) -> list[TensorName]:
    """A decoder layer's two norms and attention (``prefix``: ``model.layers.{i}.``): q/k/v/o projections, the
    QK-norm scales and the projection biases ``attention`` has, in the names transformers' decoders share."""
    names = [
        TensorName(prefix + "input_layernorm.weight", (*block, "attn_norm", "weight"), (repeat,)),
        TensorName(prefix + "post_attention_layernorm.weight", (*block, "pre_norm", "weight"), (repeat,)),
        TensorName(prefix + "self_attn.q_proj.weight", (*block, "attention", "wq"), (repeat,), 1),
        TensorName(prefix + "self_attn.k_proj.weight", (*block, "attention", "wk"), (repeat,), 1),
        TensorName(prefix + "self_attn.v_proj.weight", (*block, "attention", "wv"), (repeat,), 1),
        TensorName(prefix + "self_attn.o_proj.weight", (*block, "attention", "wo"), (repeat,), 2),
    ]
    if attention.qk_norm != "none":
        for norm in ("q_norm", "k_norm"):
            names.append(
                TensorName(prefix + f"self_attn.{norm}.weight", (*block, "attention", norm, "weight"), (repeat,))
            )
    biased = {"none": "", "qkv": "qkv", "qkvo": "qkvo"}[attention.bias]
    for proj in biased:  # q/k/v biases are per head in the model, flat [heads * head_dim] in the checkpoint
        key = prefix + f"self_attn.{proj}_proj.bias"
        names.append(TensorName(key, (*block, "attention", f"b{proj}"), (repeat,), flat=proj != "o"))
    return names


SWIGLU_NAMES = (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down"))


def swiglu_names(prefix: str, path: tuple, index: tuple[int, ...]) -> list[TensorName]:
    """The gate/up/down projections of the SwiGLU at ``path`` (a dense FFN, one routed expert with its index,
    a shared expert), under ``prefix`` (``model.layers.{i}.mlp.``) in transformers' names."""
    return [TensorName(f"{prefix}{hub}.weight", (*path, leaf), index, 1) for hub, leaf in SWIGLU_NAMES]


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

    def __post_init__(self):
        for name in ("config_from_hf", "config_to_hf", "checkpoint_names"):
            if getattr(self, name) is None:
                if self.hf_model_type is not None:
                    raise ValueError(f"family {self.name!r} has a Hugging Face model_type but no {name}")
                object.__setattr__(self, name, _no_hf_format(self.name))
        for preset, config in self.presets.items():
            if config.family != self.name:
                raise ValueError(f"preset {preset!r} of family {self.name!r} says family={config.family!r}")


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
        if family.hf_model_type is not None and family.hf_model_type == model_type:
            return family
    known = sorted(f.hf_model_type for _, f in FAMILIES.items() if f.hf_model_type)
    raise ValueError(f"{source}: model_type {model_type!r} is not supported; allowed: {' | '.join(known)}")


def all_presets() -> dict[str, ModelConfig]:
    return {name: config for _, family in FAMILIES.items() for name, config in family.presets.items()}
