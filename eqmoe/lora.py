"""LoRA as a model transformation: :func:`add_lora` gives every targeted weight an adapter, :func:`merge_lora`
folds the adapters back into the weights (for export), :func:`lora_targets` names what can be targeted.

Targets are groups (``attention``, ``mlp``, ``router``, ``experts``) or single matrices of a group
(``attention.q``, ``experts.down``, ...). Adapters are :mod:`eqmoe.nn.lora` layers with role
``Role.ADAPTER``; ``A`` is drawn uniformly in ``±1 / sqrt(fan_in)`` (PEFT's Kaiming-uniform bound for
``a = sqrt(5)``), ``B`` is zero, so an adapted model starts equal to its base. Stacked layers (``lax.scan``
segments) get stacked adapters, and routed experts one adapter per expert.
"""

import dataclasses
import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from eqmoe.nn.attention import Attention
from eqmoe.nn.dispatch import Experts
from eqmoe.nn.lora import AttentionAdapters, ExpertAdapters, MLPAdapters, RouterAdapter, merged_weight
from eqmoe.nn.mlp import SwiGLU
from eqmoe.nn.router import Router

# group -> (layer class, {member: (weight field, number of input axes, number of output axes)}, adapter class)
_GROUPS: dict[str, tuple[type, dict[str, tuple[str, int, int]], type]] = {
    "attention": (
        Attention,
        {"q": ("wq", 1, 2), "k": ("wk", 1, 2), "v": ("wv", 1, 2), "o": ("wo", 2, 1)},
        AttentionAdapters,
    ),
    "mlp": (SwiGLU, {"gate": ("w_gate", 1, 1), "up": ("w_up", 1, 1), "down": ("w_down", 1, 1)}, MLPAdapters),
    "experts": (Experts, {"gate": ("w_gate", 1, 1), "up": ("w_up", 1, 1), "down": ("w_down", 1, 1)}, ExpertAdapters),
    "router": (Router, {"": ("weight", 1, 1)}, RouterAdapter),
}


def lora_targets() -> tuple[str, ...]:
    """Every name :class:`LoRAConfig` accepts in ``targets``."""
    names = []
    for group, (_, members, _) in _GROUPS.items():
        names.append(group)
        names += [f"{group}.{member}" for member in members if member]
    return tuple(names)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Which weights get adapters and their shape: ``rank``, ``alpha`` (``scale = alpha / rank``), and the
    training-time ``dropout`` on the adapters' inputs. As in PEFT, dropout applies to the adapters of linear maps
    (attention, dense FFNs); the router's and the routed experts' adapters take their inputs undropped (PEFT
    refuses ``lora_dropout`` for parameter targets, which is how it adapts those)."""

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

    def members(self, group: str) -> tuple[str, ...]:
        """The matrices of ``group`` this config adapts."""
        _, members, _ = _GROUPS[group]
        if group in self.targets:
            return tuple(members)
        return tuple(m for m in members if f"{group}.{m}" in self.targets)


def _is_target(node) -> bool:
    return isinstance(node, tuple(cls for cls, _, _ in _GROUPS.values()))


def _group_of(layer) -> str:
    return next(group for group, (cls, _, _) in _GROUPS.items() if isinstance(layer, cls))


def _adapters(layer, group: str, config: LoRAConfig, key: PRNGKeyArray):
    _, members, adapter_cls = _GROUPS[group]
    chosen = config.members(group)
    fields = {}
    keys = jax.random.split(key, len(members))
    for (member, (weight_name, inputs, outputs)), k in zip(members.items(), keys, strict=True):
        prefix = f"{member}_" if member else ""
        if member not in chosen:
            fields[prefix + "a"], fields[prefix + "b"] = None, None
            continue
        weight = getattr(layer, weight_name)
        lead = weight.shape[: weight.ndim - inputs - outputs]  # stacked layers (+ experts)
        in_shape, out_shape = weight.shape[len(lead) : len(lead) + inputs], weight.shape[len(lead) + inputs :]
        fan_in = math.prod(in_shape)
        bound = fan_in**-0.5
        fields[prefix + "a"] = jax.random.uniform(k, (*lead, *in_shape, config.rank), jnp.float32, -bound, bound)
        fields[prefix + "b"] = jnp.zeros((*lead, config.rank, *out_shape), jnp.float32)
    adapters = object.__new__(adapter_cls)  # the fields are the dataclass's; no __init__ logic to run
    extra = {"dropout": config.dropout} if group in ("attention", "mlp") else {}
    for name, value in {**fields, "scale": config.scale, **extra}.items():
        object.__setattr__(adapters, name, value)
    adapters.__check_init__()
    return adapters


def adapter_member(layer, weight_name: str) -> str | None:
    """The adapter field prefix (``q_``, ``gate_``, ``""`` for the router) of ``layer``'s weight ``weight_name``,
    or None when LoRA cannot target it."""
    if not _is_target(layer):
        return None
    _, members, _ = _GROUPS[_group_of(layer)]
    return next((f"{m}_" if m else "" for m, (field, _, _) in members.items() if field == weight_name), None)


def _target_layers(model) -> list:
    return [leaf for leaf in jax.tree.leaves(model, is_leaf=_is_target) if _is_target(leaf)]


def add_lora(model, config: LoRAConfig, *, key: PRNGKeyArray):
    """``model`` with adapters on every weight ``config`` targets (``ValueError`` when the model has none of
    a targeted group, e.g. ``mlp`` on an all-MoE model)."""
    layers = [layer for layer in _target_layers(model) if config.members(_group_of(layer))]
    groups = {_group_of(layer) for layer in layers}
    missing = sorted({t.split(".")[0] for t in config.targets} - groups)
    if missing:
        raise ValueError(f"LoRAConfig.targets: the model has no {', '.join(missing)} layer to adapt")
    keys = jax.random.split(key, len(layers))
    adapters = [_adapters(layer, _group_of(layer), config, k) for layer, k in zip(layers, keys, strict=True)]

    def where(m):
        return [layer.lora for layer in _target_layers(m) if config.members(_group_of(layer))]

    return eqx.tree_at(where, model, adapters, is_leaf=lambda x: x is None)


def _merge_layer(layer):
    adapters = getattr(layer, "lora", None)
    if adapters is None:
        return layer
    _, members, _ = _GROUPS[_group_of(layer)]
    for member, (weight_name, _, _) in members.items():
        prefix = f"{member}_" if member else ""
        a, b = getattr(adapters, prefix + "a"), getattr(adapters, prefix + "b")
        merged = merged_weight(getattr(layer, weight_name), a, b, adapters.scale)
        layer = eqx.tree_at(lambda x, n=weight_name: getattr(x, n), layer, merged)
    return eqx.tree_at(lambda x: x.lora, layer, None, is_leaf=lambda x: x is None)


def merge_lora(model):
    """``model`` with every adapter folded into its weight (``W + scale * A @ B``) and no adapters left."""
    return _map_targets(model, _merge_layer)


def _map_targets(model, function: Callable):
    return jax.tree.map(lambda node: function(node) if _is_target(node) else node, model, is_leaf=_is_target)


def split_adapters(model) -> tuple:
    """``(model without adapters, the adapters of each targeted layer in order)``: undone by :func:`put_adapters`."""
    adapters = [layer.lora for layer in _target_layers(model)]
    bare = _map_targets(model, lambda layer: eqx.tree_at(lambda x: x.lora, layer, None, is_leaf=lambda x: x is None))
    return bare, adapters


def put_adapters(model, adapters: list):
    """``model`` (without adapters, the architecture :func:`split_adapters` took them from) with ``adapters``."""
    return eqx.tree_at(
        lambda m: [layer.lora for layer in _target_layers(m)], model, adapters, is_leaf=lambda x: x is None
    )


def has_lora(model) -> bool:
    """Whether any layer of ``model`` carries adapters."""
    return any(getattr(layer, "lora", None) is not None for layer in _target_layers(model))
