"""The routed experts of a MoE layer: stacked gated-unit matrices that carry their own biases and adapters.

``expert_e(x) = down_e(act(gate_e(x), up_e(x)))`` with ``act`` the configured unit (:mod:`eqmoe.nn.activations`;
``silu(gate) * up`` by default), each of ``gate``, ``up``, ``down`` an
:class:`~eqmoe.nn.linear.ExpertLinear`. The dispatch backends (:mod:`eqmoe.nn.dispatch`) decide which rows meet
which expert and call :meth:`RoutedExperts.apply` with the products of their layout; the grouped kernel
(:mod:`eqmoe.nn.grouped`) runs one expert at a time through :meth:`RoutedExperts.fused`. None of them knows
whether a matrix has a bias or a LoRA adapter.
"""

from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, PRNGKeyArray

from eqmoe.nn._init import Init
from eqmoe.nn.activations import SWIGLU, ExpertActivation
from eqmoe.nn.linear import ExpertLinear, Linear, LowRank
from eqmoe.params import Layer, Role

Product = Callable[[ExpertLinear, Array], Array]


class RoutedExperts(Layer):
    """``num_experts`` gated experts stored as stacked matrices (``[experts, embed, expert_mlp]`` in,
    ``[experts, expert_mlp, embed]`` out), with biases when ``bias`` (gpt-oss) and the unit ``activation``."""

    adapter_group: ClassVar[str] = "experts"

    gate: ExpertLinear
    up: ExpertLinear
    down: ExpertLinear
    activation: ExpertActivation = eqx.field(static=True)

    def __init__(
        self,
        num_experts: int,
        embed_dim: int,
        expert_dim: int,
        *,
        init: Init,
        key: PRNGKeyArray,
        bias: bool = False,
        activation: ExpertActivation = SWIGLU,
    ):
        k_gate, k_up, k_down = jax.random.split(key, 3)
        into = dict(role=Role.EXPERT, in_axes=("embed",), out_axes=("expert_mlp",), init=init, bias=bias)
        self.gate = ExpertLinear(num_experts, (embed_dim,), (expert_dim,), key=k_gate, **into)
        self.up = ExpertLinear(num_experts, (embed_dim,), (expert_dim,), key=k_up, **into)
        self.down = ExpertLinear(
            num_experts,
            (expert_dim,),
            (embed_dim,),
            role=Role.EXPERT,
            in_axes=("expert_mlp",),
            out_axes=("embed",),
            init=init,
            key=k_down,
            bias=bias,
        )
        self.activation = activation

    @property
    def num_experts(self) -> int:
        return self.gate.weight.shape[-3]

    @property
    def expert_dim(self) -> int:
        return self.gate.weight.shape[-1]

    def apply(self, x: Array, into: Product, out_of: Product) -> Array:
        """The experts on ``x`` with a backend's products: ``into(w, x)`` for the input side (``gate``, ``up``),
        ``out_of(w, h)`` for the output side (``down``)."""
        gate, up = checkpoint_name(into(self.gate, x), "experts"), checkpoint_name(into(self.up, x), "experts")
        return checkpoint_name(out_of(self.down, self.activation(gate, up)), "experts")  # kept by remat "dots"

    def fused(self) -> "FusedExpert":
        """One expert (a slice of the stack, taken inside a scan over experts) with ``gate`` and ``up`` as one
        ``[embed, 2 * expert_dim]`` product, so rows go through one matmul on each side; differentiable, so a
        kernel maps gradients of the fused expert back with ``jax.vjp``."""
        return FusedExpert(_concatenate(self.gate, self.up), self.down, self.activation)


class FusedExpert(eqx.Module):
    """One expert with its input side fused: ``down(activation(gate_up(x)))``; ``gate_up``'s output is the gate
    pre-activations then the up ones."""

    gate_up: Linear
    down: Linear
    activation: ExpertActivation = eqx.field(static=True)

    def pre_activations(self, x: Float[Array, "rows embed"]) -> Float[Array, "rows gate_up"]:
        return self.gate_up(x)

    def output(self, pre: Float[Array, "rows gate_up"]) -> Float[Array, "rows embed"]:
        width = pre.shape[-1] // 2
        return self.down(self.activation(pre[:, :width], pre[:, width:]))


def _concatenate(gate: Linear, up: Linear) -> Linear:
    """``gate`` and ``up`` (one expert's, same input) as one product whose outputs are ``gate``'s then ``up``'s.

    Adapters become one adapter of the summed rank: ``A = [A_gate | A_up]`` and a block-diagonal ``B`` (a side
    without adapter contributes none), the same update exactly."""
    weight = jnp.concatenate([gate.matrix(), up.matrix()], axis=-1)
    width = gate.matrix().shape[-1]
    bias = None
    if gate.bias is not None or up.bias is not None:
        biases = [side.flat_bias() for side in (gate, up)]
        bias = jnp.concatenate([b if b is not None else jnp.zeros((width,), weight.dtype) for b in biases], axis=-1)
    factors = []
    for side, first in ((gate, True), (up, False)):
        if side.adapter is not None:
            a, b = side.adapter.matrices()
            zeros = jnp.zeros_like(b)
            factors.append((a, jnp.concatenate([b, zeros] if first else [zeros, b], axis=-1) * side.adapter.scale))
    adapter = None
    if factors:
        a = jnp.concatenate([a for a, _ in factors], axis=-1)
        adapter = LowRank.holding(a, jnp.concatenate([b for _, b in factors], axis=-2))
    return Linear.holding(weight, bias, adapter, role=gate.role)
