"""RMSNorm with Hugging Face dtype semantics."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float

from eqmoe.config import NormConfig
from eqmoe.params import Layer, Role, param


class RMSNorm(Layer):
    """Root-mean-square norm over the last axis with a learnable scale.

    HF Qwen3MoeRMSNorm (``stats_dtype="float32"``): the statistics are taken in float32, the normalised
    values are cast back to the input dtype, and only then multiplied by the weight:
    ``weight * (x32 * rsqrt(mean(x32^2) + eps)).astype(x.dtype)``. AXLearn (``stats_dtype="input"``)
    computes the same in the input dtype throughout. ``zero_centered`` (Qwen3-Next, Qwen3.5) holds the scale as
    its offset from 1, initialised at 0: ``((1 + weight) * x32 * rsqrt(mean(x32^2) + eps)).astype(x.dtype)``, the
    product taken in float32 before the cast.
    """

    weight: Float[Array, " norm"] = param(Role.NORM)
    eps: float = eqx.field(static=True)
    stats_dtype: str = eqx.field(static=True)
    zero_centered: bool = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        *,
        eps: float,
        dtype: DTypeLike = jnp.float32,
        stats_dtype: str = "float32",
        zero_centered: bool = False,
    ):
        self.weight = (jnp.zeros if zero_centered else jnp.ones)((dim,), dtype)
        self.eps = eps
        self.stats_dtype = stats_dtype
        self.zero_centered = zero_centered

    @classmethod
    def of(cls, config: NormConfig, dim: int, dtype: DTypeLike, eps: float | None = None) -> "RMSNorm":
        """A norm over ``dim`` as ``config`` describes the model's norms (``eps``: another epsilon than its own)."""
        return cls(
            dim,
            eps=config.eps if eps is None else eps,
            dtype=dtype,
            stats_dtype=config.stats_dtype,
            zero_centered=config.zero_centered,
        )

    def __call__(self, x: Float[Array, "*batch norm"]) -> Float[Array, "*batch norm"]:
        stats = x.astype(jnp.float32) if self.stats_dtype == "float32" else x
        normed = stats * jax.lax.rsqrt(jnp.mean(jnp.square(stats), axis=-1, keepdims=True) + self.eps)
        if self.zero_centered:
            return ((1.0 + self.weight.astype(normed.dtype)) * normed).astype(x.dtype)
        return self.weight.astype(x.dtype) * normed.astype(x.dtype)
