"""The gated units of routed experts: what an expert computes between its input side (gate, up) and its output side.

Each is a function ``activation(gate, up, spec) -> hidden`` registered in :data:`eqmoe.registries.FFN_ACTIVATIONS`
under the name ``MoEConfig.activation`` uses; ``spec`` (:class:`ExpertActivation`) carries the constants a unit
reads. Every dispatch backend, the grouped kernel (forward and backward) and expert parallelism call the experts'
:meth:`~eqmoe.nn.experts.RoutedExperts.apply` or :meth:`~eqmoe.nn.experts.RoutedExperts.fused`, which apply the
unit, so a new one is a function and a registration line.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from eqmoe.config import MoEConfig
from eqmoe.nn.mlp import silu
from eqmoe.registries import FFN_ACTIVATIONS

Hidden = Float[Array, "*rows width"]


@dataclass(frozen=True)
class ExpertActivation:
    """Which registered unit the experts apply, with the constants of ``MoEConfig`` it reads (hashable: it is a
    static field of the experts)."""

    name: str = "swiglu"
    alpha: float = 1.702
    limit: float = 7.0

    @classmethod
    def of(cls, config: MoEConfig) -> "ExpertActivation":
        return cls(config.activation, config.swiglu_alpha, config.swiglu_limit)

    def __call__(self, gate: Hidden, up: Hidden) -> Hidden:
        return FFN_ACTIVATIONS.get(self.name)(gate, up, self)


SWIGLU = ExpertActivation()


def swiglu(gate: Hidden, up: Hidden, spec: ExpertActivation) -> Hidden:
    """``silu(gate) * up`` (Qwen3-MoE, Mixtral, DeepSeek, ...)."""
    return silu(gate) * up


def clamped_swiglu(gate: Hidden, up: Hidden, spec: ExpertActivation) -> Hidden:
    """gpt-oss: ``(clip(up, -L, L) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, L)``, in float32 and
    rounded once (transformers' ``GptOssExperts._apply_gate``; the clamps keep the product bounded in bfloat16)."""
    g = jnp.minimum(gate.astype(jnp.float32), spec.limit)
    u = jnp.clip(up.astype(jnp.float32), -spec.limit, spec.limit)
    return ((u + 1.0) * g * jax.nn.sigmoid(spec.alpha * g)).astype(gate.dtype)


FFN_ACTIVATIONS.register("swiglu", swiglu)
FFN_ACTIVATIONS.register("clamped_swiglu", clamped_swiglu)
