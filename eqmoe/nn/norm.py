"""RMSNorm with Hugging Face dtype semantics."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float

from eqmoe.params import Layer, Role, param


class RMSNorm(Layer):
    """Root-mean-square norm over the last axis with a learnable scale.

    HF Qwen3MoeRMSNorm (``stats_dtype="float32"``): the statistics are taken in float32, the normalised
    values are cast back to the input dtype, and only then multiplied by the weight:
    ``weight * (x32 * rsqrt(mean(x32^2) + eps)).astype(x.dtype)``. AXLearn (``stats_dtype="input"``)
    computes the same in the input dtype throughout.
    """

    weight: Float[Array, " norm"] = param(Role.NORM)
    eps: float = eqx.field(static=True)
    stats_dtype: str = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float, dtype: DTypeLike = jnp.float32, stats_dtype: str = "float32"):
        self.weight = jnp.ones((dim,), dtype)
        self.eps = eps
        self.stats_dtype = stats_dtype

    def __call__(self, x: Float[Array, "*batch norm"]) -> Float[Array, "*batch norm"]:
        stats = x.astype(jnp.float32) if self.stats_dtype == "float32" else x
        normed = stats * jax.lax.rsqrt(jnp.mean(jnp.square(stats), axis=-1, keepdims=True) + self.eps)
        return self.weight.astype(x.dtype) * normed.astype(x.dtype)
