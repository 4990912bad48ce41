"""LoRA as a model transformation: :func:`add_lora` gives every targeted matrix an adapter, :func:`merge_lora`
folds the adapters back into the weights (for export), :func:`lora_targets` names what can be targeted.

Every matrix of the model is a :class:`~eqmoe.nn.linear.Linear`, which carries its own adapter
(:class:`~eqmoe.nn.linear.LowRank`); the parts that hold them (attention kinds, FFN kinds and their pieces) each
name an ``adapter_group``, and a target is a group (``attention``, ``mlp``, ``experts``, ``router``) or one of its
matrices by field name (``attention.q``, ``experts.down``): the names come from the registered parts themselves,
so a newly registered attention kind's matrices are targets at once. ``A`` is drawn uniformly in
``±1 / sqrt(fan_in)`` (PEFT's Kaiming-uniform bound for ``a = sqrt(5)``), ``B`` is zero, so an adapted model starts
equal to its base. Stacked layers (``lax.scan`` segments) get stacked adapters, and routed experts one adapter per
expert.
"""

import dataclasses
import math
import typing
from collections.abc import Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from eqmoe.nn.fp8 import is_block_fp8
from eqmoe.nn.linear import Linear, LowRank
from eqmoe.params import Layer
from eqmoe.registries import ATTENTION_KINDS, FFN_KINDS


def _dropout_groups() -> set[str]:
    """The groups whose adapters take dropout: PEFT applies lora_dropout to the adapters of linear maps (every
    attention kind's matrices, dense FFNs); it refuses dropout for parameter targets, which is how it adapts routed
    experts and routers, so those take their inputs undropped."""
    return {cls.adapter_group for _, cls in ATTENTION_KINDS.items()} | {"mlp"}


def _linear_fields(cls: type) -> tuple[str, ...]:
    """The fields of the module class ``cls`` that hold a :class:`Linear` (possibly ``None``), in order."""
    hints = typing.get_type_hints(cls)
    fields = []
    for field in dataclasses.fields(cls):
        hint = hints.get(field.name)
        if any(isinstance(t, type) and issubclass(t, Linear) for t in (hint, *typing.get_args(hint))):
            fields.append(field.name)
    return tuple(fields)


def _part_classes() -> list[type]:
    """Every module class reachable from the registered attention and FFN kinds through their fields."""
    found: list[type] = []
    pending = [cls for registry in (ATTENTION_KINDS, FFN_KINDS) for _, cls in registry.items()]
    while pending:
        cls = pending.pop(0)
        if cls in found:
            continue
        found.append(cls)
        for hint in typing.get_type_hints(cls).values():
            for t in (hint, *typing.get_args(hint)):
                if isinstance(t, type) and issubclass(t, Layer) and not issubclass(t, Linear):
                    pending.append(t)
    return found


def adapter_groups() -> dict[str, tuple[str, ...]]:
    """``{group: its matrices}`` over every registered part (``{"attention": ("q", "k", "v", "o"), ...}``)."""
    groups: dict[str, list[str]] = {}
    for cls in _part_classes():
        group = getattr(cls, "adapter_group", None)
        if group is not None:
            members = groups.setdefault(group, [])
            members += [name for name in _linear_fields(cls) if name not in members]
    return {group: tuple(members) for group, members in groups.items()}


def lora_targets() -> tuple[str, ...]:
    """Every name :class:`LoRAConfig` accepts in ``targets``: each group and each ``group.matrix``."""
    names = []
    for group, members in adapter_groups().items():
        names += [group, *(f"{group}.{member}" for member in members)]
    return tuple(names)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Which weights get adapters and their shape: ``rank``, ``alpha`` (``scale = alpha / rank``), and the
    training-time ``dropout`` on the adapters' inputs. As in PEFT, dropout applies to the adapters of linear maps
    (every attention kind's, linear attention's included, and dense FFNs'); the router's and the routed experts'
    adapters take their inputs undropped (PEFT refuses ``lora_dropout`` for parameter targets, which is how it adapts
    those)."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("attention", "experts")
    dropout: float = 0.0

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoRAConfig.rank={self.rank!r} is invalid; allowed: an integer >= 1")
        if not self.alpha > 0:
            raise ValueError(f"LoRAConfig.alpha={self.alpha!r} is invalid; allowed: a number > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRAConfig.dropout={self.dropout!r} is invalid; allowed: 0 <= dropout < 1")
        if not self.targets:
            raise ValueError("LoRAConfig.targets is empty; allowed: " + ", ".join(lora_targets()))
        unknown = [t for t in self.targets if t not in lora_targets()]
        if unknown:
            allowed = ", ".join(lora_targets())
            raise ValueError(f"LoRAConfig.targets: unknown {', '.join(map(repr, unknown))}; allowed: {allowed}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def adapts(self, group: str, member: str) -> bool:
        return group in self.targets or f"{group}.{member}" in self.targets


def _is_part(node) -> bool:
    return isinstance(node, Layer) and getattr(node, "adapter_group", None) is not None


def _parts(model) -> Iterator[Layer]:
    """Every part of ``model`` that names an adapter group, in tree order (outer parts before inner ones)."""

    def walk(node):
        for leaf in jax.tree.leaves(node, is_leaf=lambda x: x is not node and isinstance(x, Layer)):
            if isinstance(leaf, Layer) and not isinstance(leaf, Linear) and getattr(leaf, "holds_adapters", True):
                if _is_part(leaf):
                    yield leaf
                yield from walk(leaf)

    yield from walk(model)


def targets(model, config: LoRAConfig | None = None) -> list[tuple[str, str, Linear]]:
    """``(group, matrix, linear)`` of every matrix of ``model`` LoRA can target (``config``: only those it
    adapts), in tree order."""
    found = []
    for part in _parts(model):
        group = part.adapter_group
        for name in _linear_fields(type(part)):
            linear = getattr(part, name)
            # isinstance, not "is not None": inside eqx.tree_at an absent matrix (None) is a wrapped leaf
            if isinstance(linear, Linear) and (config is None or config.adapts(group, name)):
                found.append((group, name, linear))
    return found


def _adapter(linear: Linear, group: str, config: LoRAConfig, key: PRNGKeyArray) -> LowRank:
    dims = len(linear.in_axes) + len(linear.out_axes)
    lead = linear.weight.shape[: linear.weight.ndim - dims]  # stacked layers (+ experts)
    in_shape = linear.weight.shape[len(lead) : len(lead) + len(linear.in_axes)]
    out_shape = linear.weight.shape[len(lead) + len(linear.in_axes) :]
    bound = math.prod(in_shape) ** -0.5
    return LowRank(
        a=jax.random.uniform(key, (*lead, *in_shape, config.rank), jnp.float32, -bound, bound),
        b=jnp.zeros((*lead, config.rank, *out_shape), jnp.float32),
        scale=config.scale,
        dropout=config.dropout if group in _dropout_groups() else 0.0,
        lead_axes=linear.lead_axes,
        in_axes=linear.in_axes,
        out_axes=linear.out_axes,
    )


def _adapted_linears(model, config: LoRAConfig):
    return [linear for _, _, linear in targets(model, config)]


def add_lora(model, config: LoRAConfig, *, key: PRNGKeyArray):
    """``model`` with adapters on every matrix ``config`` targets (``ValueError`` when the model has none of a
    targeted group, e.g. ``mlp`` on an all-MoE model)."""
    found = targets(model, config)
    missing = sorted({t.split(".")[0] for t in config.targets} - {group for group, _, _ in found})
    if missing:
        raise ValueError(f"LoRAConfig.targets: the model has no {', '.join(missing)} layer to adapt")
    keys = jax.random.split(key, len(found))
    adapters = [_adapter(linear, group, config, k) for (group, _, linear), k in zip(found, keys, strict=True)]
    return eqx.tree_at(
        lambda m: [linear.adapter for linear in _adapted_linears(m, config)], model, adapters, is_leaf=_is_none
    )


def _is_none(node) -> bool:
    return node is None


def _map_linears(model, function):
    is_linear = lambda node: isinstance(node, Linear)  # noqa: E731
    return jax.tree.map(lambda node: function(node) if is_linear(node) else node, model, is_leaf=is_linear)


def _merged(linear: Linear, dtype) -> Linear:
    if linear.adapter is None:
        return linear
    held = linear.weight_array()  # a block-FP8 weight dequantized, in float32
    dtype = dtype if is_block_fp8(linear.weight) else held.dtype
    weight = (held + linear.adapter.delta()).astype(dtype)
    return eqx.tree_at(lambda x: (x.weight, x.adapter), linear, (weight, None), is_leaf=_is_none)


def merge_lora(model):
    """``model`` with every adapter folded into its weight (``W + scale * A @ B``) and no adapters left. An adapter
    over a block-FP8 weight gives the dequantized weight plus the adapter, in the model's parameter dtype (float32
    for a tree without a config); block-FP8 weights without an adapter stay as they are."""
    dtype = jnp.dtype(getattr(getattr(model, "config", None), "param_dtype", "float32"))
    return _map_linears(model, lambda linear: _merged(linear, dtype))


def has_lora(model) -> bool:
    """Whether any matrix of ``model`` carries an adapter."""
    is_linear = lambda node: isinstance(node, Linear)  # noqa: E731
    return any(is_linear(node) and node.adapter is not None for node in jax.tree.leaves(model, is_leaf=is_linear))
