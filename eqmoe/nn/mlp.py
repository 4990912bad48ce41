"""The gated feed-forward network (SwiGLU)."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from eqmoe.nn._init import Init
from eqmoe.nn._params import Layer, Role, param
from eqmoe.nn.lora import MLPAdapters, adapted


def silu(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """SiLU evaluated in float32 and rounded once to the input dtype, as torch does for bfloat16
    (``jax.nn.silu`` on bfloat16 rounds the sigmoid first, one ulp off in ~40% of values)."""
    return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


class SwiGLU(Layer):
    """``down(silu(x @ gate) * (x @ up))``, no biases (HF Qwen3MoeMLP)."""

    w_gate: Float[Array, "embed mlp"] = param(Role.MLP)
    w_up: Float[Array, "embed mlp"] = param(Role.MLP)
    w_down: Float[Array, "mlp embed"] = param(Role.MLP)
    lora: MLPAdapters | None

    def __init__(self, embed_dim: int, mlp_dim: int, *, init: Init, key: PRNGKeyArray):
        k_gate, k_up, k_down = jax.random.split(key, 3)
        self.w_gate = init.weight(k_gate, (embed_dim, mlp_dim), fan_in=embed_dim)
        self.w_up = init.weight(k_up, (embed_dim, mlp_dim), fan_in=embed_dim)
        self.w_down = init.weight(k_down, (mlp_dim, embed_dim), fan_in=mlp_dim)
        self.lora = None

    def __call__(
        self, x: Float[Array, "*batch embed"], key: PRNGKeyArray | None = None
    ) -> Float[Array, "*batch embed"]:
        # Matmuls on a flat [tokens, embed] matrix: XLA:CPU's backward pass is several times slower
        # when the token axes stay split into [batch, seq].
        flat = x.reshape(-1, x.shape[-1])
        gate, up = adapted(flat, self.w_gate, self.lora, "gate", key), adapted(flat, self.w_up, self.lora, "up", key)
        return adapted(silu(gate) * up, self.w_down, self.lora, "down", key).reshape(x.shape)
