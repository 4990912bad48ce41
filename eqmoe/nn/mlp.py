"""The gated feed-forward network (SwiGLU)."""

import equinox as eqx
import jax
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from eqmoe.nn._init import normal


class SwiGLU(eqx.Module):
    """``down(silu(x @ gate) * (x @ up))``, no biases (HF Qwen3MoeMLP)."""

    w_gate: Float[Array, "embed mlp"]
    w_up: Float[Array, "embed mlp"]
    w_down: Float[Array, "mlp embed"]

    def __init__(self, embed_dim: int, mlp_dim: int, *, std: float, dtype: DTypeLike, key: PRNGKeyArray):
        k_gate, k_up, k_down = jax.random.split(key, 3)
        self.w_gate = normal(k_gate, (embed_dim, mlp_dim), std, dtype)
        self.w_up = normal(k_up, (embed_dim, mlp_dim), std, dtype)
        self.w_down = normal(k_down, (mlp_dim, embed_dim), std, dtype)

    def __call__(self, x: Float[Array, "*batch embed"]) -> Float[Array, "*batch embed"]:
        hidden = jax.nn.silu(x @ self.w_gate) * (x @ self.w_up)
        return hidden @ self.w_down
