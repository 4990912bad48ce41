"""RMSNorm with Hugging Face dtype semantics."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float


class RMSNorm(eqx.Module):
    """Root-mean-square norm over the last axis with a learnable scale.

    HF Qwen3MoeRMSNorm: the statistics are taken in float32, the normalised values are cast back to
    the input dtype, and only then multiplied by the weight:
    ``weight * (x32 * rsqrt(mean(x32^2) + eps)).astype(x.dtype)``.
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float, dtype: DTypeLike = jnp.float32):
        self.weight = jnp.ones((dim,), dtype)
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return self.weight.astype(x.dtype) * normed.astype(x.dtype)
