"""The gated feed-forward network (SwiGLU): the ``dense`` FFN kind, and the shared experts of a MoE layer."""

from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from eqmoe.config import LayerKind, ModelConfig
from eqmoe.nn._init import Init
from eqmoe.nn.context import Context
from eqmoe.nn.kinds import Cost, FFNKind, PlanShape
from eqmoe.nn.linear import Linear
from eqmoe.params import Role
from eqmoe.registries import FFN_KINDS


def silu(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """SiLU evaluated in float32 and rounded once to the input dtype, as torch does for bfloat16
    (``jax.nn.silu`` on bfloat16 rounds the sigmoid first, one ulp off in ~40% of values)."""
    return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


@FFN_KINDS.register("dense")
class SwiGLU(FFNKind):
    """``down(silu(gate(x)) * up(x))``, no biases (HF Qwen3MoeMLP): a dense layer's FFN of width
    ``ModelConfig.mlp_dim``, and a MoE layer's shared experts."""

    adapter_group: ClassVar[str] = "mlp"

    gate: Linear
    up: Linear
    down: Linear

    def __init__(self, embed_dim: int, mlp_dim: int, *, init: Init, key: PRNGKeyArray):
        k_gate, k_up, k_down = jax.random.split(key, 3)
        into = dict(role=Role.MLP, in_axes=("embed",), out_axes=("mlp",), init=init)
        self.gate = Linear((embed_dim,), (mlp_dim,), key=k_gate, **into)
        self.up = Linear((embed_dim,), (mlp_dim,), key=k_up, **into)
        self.down = Linear(
            (mlp_dim,), (embed_dim,), role=Role.MLP, in_axes=("mlp",), out_axes=("embed",), init=init, key=k_down
        )

    @classmethod
    def build(cls, config: ModelConfig, layer: LayerKind, *, init: Init, key: PRNGKeyArray) -> "SwiGLU":
        return cls(config.embed_dim, config.mlp_dim, init=init, key=key)

    def __call__(
        self, x: Float[Array, "*batch embed"], context: Context | None = None, key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, "*batch embed"], None]:
        """``key``: the randomness of training-time adapter dropout (``None``: none)."""
        # Matmuls on a flat [tokens, embed] matrix: XLA:CPU's backward pass is several times slower
        # when the token axes stay split into [batch, seq].
        flat = x.reshape(-1, x.shape[-1])
        keys = (None,) * 3 if key is None else [jax.random.fold_in(key, i) for i in (4, 5, 6)]
        hidden = silu(self.gate(flat, keys[0])) * self.up(flat, keys[1])
        return self.down(hidden, keys[2]).reshape(x.shape), None

    @classmethod
    def plan(cls, config: ModelConfig, layer: LayerKind, shape: PlanShape) -> Cost:
        """Kept per token: the input and its norm, the gate and up projections and their product."""
        return Cost(shape.bytes * (2 * config.embed_dim + 3 * shape.split(config.mlp_dim or 0)))

    @classmethod
    def check(cls, config: ModelConfig, layer: LayerKind) -> None:
        if not (config.mlp_dim is not None and config.mlp_dim > 0):
            raise ValueError(
                f"ModelConfig.mlp_dim={config.mlp_dim!r} is invalid; allowed: a positive width (a dense layer)"
            )
