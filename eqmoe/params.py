"""What each parameter is, declared once where it is created.

A layer declares every array field with :func:`param` and a :class:`Role`; the field's jaxtyping
annotation names its logical axes (``wq: Float[Array, "embed heads head_dim"] = param(Role.ATTENTION)``).
:func:`param_info` turns any tree that holds layers (a model, a train state whose optimizer moments are
shaped like the model, an abstract model) into a tree of :class:`ParamInfo`: the role, and the logical
axes with one leading ``layers`` axis per stacking (``eqx.filter_vmap``). Sharding, the optimizer's masks,
the parameter report and the checkpoint layouts read that tree instead of guessing from names.
"""

import dataclasses
import enum
import functools
import typing
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np

_ROLE = "eqmoe_role"


class Role(enum.Enum):
    """What a parameter is to the optimizer, the planner and the parameter report."""

    EMBEDDING = "embedding"  # token embedding table
    OUTPUT = "output"  # the output layer (lm_head)
    ATTENTION = "attention"  # query/key/value/output projections
    MLP = "mlp"  # dense FFN matrices
    EXPERT = "expert"  # routed-expert matrices: only top_k of num_experts are active per token
    ROUTER = "router"  # the router's gate
    NORM = "norm"  # RMSNorm scales
    BIAS = "bias"  # additive biases of linear maps (attention projections of Qwen2-MoE, OLMoE, GLM-4.5)
    SINK = "sink"  # attention sinks: a learned logit per head in every softmax (gpt-oss)
    ROUTER_BIAS = "router_bias"  # aux-loss-free selection bias: state moved outside the gradient
    ADAPTER = "adapter"  # a low-rank (LoRA) factor added to a frozen weight
    MTP = "mtp"  # a multi-token-prediction layer's parameter: kept from the files, outside the causal LM's loss

    @property
    def trained(self) -> bool:
        """Updated by the optimizer (the router bias is moved by ``eqmoe.train.balance`` instead; the
        multi-token-prediction layers take no part in the loss, so weight decay alone would move them)."""
        return self not in (Role.ROUTER_BIAS, Role.MTP)

    @property
    def hidden_matrix(self) -> bool:
        """A matrix between hidden layers, whose update mup-simple scales with width."""
        return self in (Role.ATTENTION, Role.MLP, Role.EXPERT)

    @property
    def routed(self) -> bool:
        return self is Role.EXPERT


def param(role: Role, **kwargs) -> Any:
    """Declare an array field of a :class:`Layer` as a parameter with this ``role``; its annotation gives
    the logical axes. ``kwargs`` go to ``eqx.field``."""
    return eqx.field(metadata={_ROLE: role}, **kwargs)


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One array leaf: its role (``None`` for arrays that are not parameters, such as step counters) and
    its logical axes, one per dimension (``None`` = no name, replicated)."""

    role: Role | None
    axes: tuple[str | None, ...]

    @property
    def routed(self) -> bool:
        """Part of the routed experts (only ``top_k`` of ``num_experts`` are active per token): their matrices, and
        the biases stacked over their ``experts`` axis (gpt-oss)."""
        if self.role is None:
            return False
        return self.role.routed or (self.role is Role.BIAS and "experts" in self.axes)


def _array_dims(annotation: Any) -> tuple[str, ...] | None:
    """The dimension names of a jaxtyping annotation (``X | None`` included), or ``None`` if it has none."""
    for candidate in (annotation, *typing.get_args(annotation)):
        dims = getattr(candidate, "dims", None)
        if dims is not None:
            names = tuple(getattr(dim, "name", None) for dim in dims)
            if all(isinstance(name, str) for name in names):
                return names
    return None


@functools.cache
def _declared(cls: type) -> dict[str, tuple[Role, tuple[str, ...]]]:
    """``{field: (role, axes)}`` for the parameters ``cls`` declares."""
    hints = typing.get_type_hints(cls)
    declared = {}
    for field in dataclasses.fields(cls):
        role = field.metadata.get(_ROLE)
        if role is None:
            continue
        dims = _array_dims(hints.get(field.name))
        if dims is None:
            raise TypeError(
                f"{cls.__name__}.{field.name} is declared a parameter but its annotation names no axes; "
                'annotate it like Float[Array, "embed mlp"]'
            )
        declared[field.name] = (role, dims)
    return declared


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | jax.ShapeDtypeStruct | np.ndarray)


def _undeclared(cls: type, name: str) -> TypeError:
    return TypeError(
        f"{cls.__name__}.{name} holds an array with no declared role; declare it with "
        "eqmoe.nn.param(Role.X) and name its axes in the annotation"
    )


class Layer(eqx.Module):
    """A module whose array fields are all declared parameters (:func:`param`) or sub-layers.

    An array in any other field is refused when the layer is built, so a new parameter cannot be
    silently replicated, decayed or counted as something it is not. A layer whose parameters' roles and axes
    depend on the instance (a :class:`eqmoe.nn.linear.Linear` is an attention projection in one place and an
    expert's matrix in another) overrides :meth:`declared`.
    """

    def declared(self) -> dict[str, tuple[Role, tuple[str, ...]]]:
        """``{field: (role, logical axes)}`` of this layer's parameters (by default, its class declarations)."""
        return _declared(type(self))

    def __check_init__(self):
        declared = self.declared()
        for field in dataclasses.fields(self):
            if field.name in declared or field.metadata.get("static", False):
                continue
            inner = jax.tree.leaves(getattr(self, field.name), is_leaf=lambda x: isinstance(x, Layer))
            if any(not isinstance(leaf, Layer) and _is_array(leaf) for leaf in inner):
                raise _undeclared(type(self), field.name)


def _layer_info(layer: Layer, outer_role: Role | None = None) -> Layer:
    """``layer`` with every parameter replaced by its :class:`ParamInfo` (same tree structure). A layer whose class
    sets ``parameter_role`` gives that role to every parameter inside it (nested layers included)."""
    outer_role = getattr(type(layer), "parameter_role", None) or outer_role
    declared = layer.declared()
    info = object.__new__(type(layer))
    for field in dataclasses.fields(layer):
        value = getattr(layer, field.name)
        if field.name in declared:
            role, dims = declared[field.name]

            def describe(leaf, role=role, dims=dims, name=field.name):
                stacked = len(leaf.shape) - len(dims)
                if stacked < 0:
                    raise ValueError(f"{type(layer).__name__}.{name}: shape {leaf.shape} has fewer axes than {dims}")
                return ParamInfo(outer_role or role, ("layers",) * stacked + dims)

            # a weight held in parts (a block-FP8 weight's values and scales): each part with its own axes
            parts = getattr(value, "parameter_axes", None)
            value = jax.tree.map(describe, value) if parts is None else _parts_info(value, parts(dims), describe)
        elif not field.metadata.get("static", False):

            def inner(node, name=field.name):
                if isinstance(node, Layer):
                    return _layer_info(node, outer_role)
                if _is_array(node):
                    raise _undeclared(type(layer), name)
                return node

            value = jax.tree.map(inner, value, is_leaf=lambda x: isinstance(x, Layer))
        object.__setattr__(info, field.name, value)
    return info


def _parts_info(value: Any, axes: dict[str, tuple[str, ...]], describe: Callable) -> Any:
    """``value`` (a module holding one parameter in parts) with each part's leaves described by its own ``axes``."""
    info = object.__new__(type(value))
    for field in dataclasses.fields(value):
        part = getattr(value, field.name)
        if field.name in axes:
            part = jax.tree.map(lambda leaf, dims=axes[field.name]: describe(leaf, dims=dims), part)
        object.__setattr__(info, field.name, part)
    return info


def param_info(tree: Any) -> Any:
    """``tree`` with each array leaf replaced by its :class:`ParamInfo`; other leaves are kept.

    Arrays inside a :class:`Layer` get their declared role and axes (with leading ``layers`` axes for
    stacked copies); arrays outside any layer (a step counter, a PRNG key, Adam's count) get role
    ``None`` and no axis names.
    """

    def describe(node):
        if isinstance(node, Layer):
            return _layer_info(node)
        if _is_array(node):
            return ParamInfo(None, (None,) * len(node.shape))
        return node

    return jax.tree.map(describe, tree, is_leaf=lambda x: isinstance(x, Layer))


def param_infos(tree: Any) -> list[ParamInfo]:
    """The :class:`ParamInfo` of every array leaf of ``tree``, in ``jax.tree.leaves`` order."""
    return [leaf for leaf in jax.tree.leaves(param_info(tree)) if isinstance(leaf, ParamInfo)]


def role_mask(tree: Any, predicate: Callable[[Role], bool]) -> Any:
    """``tree``'s structure with ``predicate(role)`` at every parameter and ``False`` at every other leaf: the one
    mask of which leaves are trained, frozen, decayed or saved (for ``eqx.partition`` / ``eqx.filter`` and
    ``optax.masked``)."""
    return jax.tree.map(
        lambda info: isinstance(info, ParamInfo) and info.role is not None and predicate(info.role),
        param_info(tree),
        is_leaf=lambda x: isinstance(x, ParamInfo),
    )
