"""Rotary position embedding (RoPE)."""

import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int


def rope_tables(
    positions: Int[Array, "*batch seq"], head_dim: int, theta: float, dtype: DTypeLike
) -> tuple[Float[Array, "*batch seq head_dim"], Float[Array, "*batch seq head_dim"]]:
    """Cosine and sine tables in the half-split layout, computed in float32 then cast to ``dtype``.

    HF Qwen3MoeRotaryEmbedding: ``inv_freq = theta^(-arange(0, D, 2) / D)``, ``freqs = pos * inv_freq``,
    ``emb = concat(freqs, freqs)``.
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def _rotate_half(x: Float[Array, "... head_dim"]) -> Float[Array, "... head_dim"]:
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-second, first], axis=-1)


def apply_rope(
    x: Float[Array, "*batch seq heads head_dim"],
    cos: Float[Array, "*batch seq head_dim"],
    sin: Float[Array, "*batch seq head_dim"],
) -> Float[Array, "*batch seq heads head_dim"]:
    """Rotate dimension ``i`` with ``i + D/2`` (the "rotate_half" convention of HF and MaxText)."""
    cos, sin = cos[..., None, :], sin[..., None, :]
    return x * cos + _rotate_half(x) * sin
