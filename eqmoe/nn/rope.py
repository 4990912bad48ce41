"""Rotary position embedding (RoPE) in the half-split and interleaved layouts."""

import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int


def rope_tables(
    positions: Int[Array, "*batch seq"], head_dim: int, theta: float, dtype: DTypeLike, layout: str = "half_split"
) -> tuple[Float[Array, "*batch seq head_dim"], Float[Array, "*batch seq head_dim"]]:
    """Cosine and sine of every rotation angle, per dimension, in float32 then cast to ``dtype``.

    Frequencies ``theta^(-2i / D)`` for ``i < D/2`` (HF Qwen3MoeRotaryEmbedding). Half-split lays
    the angles out as ``concat(freqs, freqs)``; interleaved as ``(f0, f0, f1, f1, ...)``.
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([freqs, freqs], axis=-1) if layout == "half_split" else jnp.repeat(freqs, 2, axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def _rotate_half(x: Float[Array, "... head_dim"]) -> Float[Array, "... head_dim"]:
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-second, first], axis=-1)


def _rotate_pairs(x: Float[Array, "... head_dim"]) -> Float[Array, "... head_dim"]:
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.stack([-odd, even], axis=-1).reshape(x.shape)


def apply_rope(
    x: Float[Array, "*batch seq heads head_dim"],
    cos: Float[Array, "*batch seq head_dim"],
    sin: Float[Array, "*batch seq head_dim"],
    layout: str = "half_split",
) -> Float[Array, "*batch seq heads head_dim"]:
    """``x * cos + rotate(x) * sin``: half-split rotates dimension ``i`` with ``i + D/2`` (HF "rotate_half",
    MaxText); interleaved rotates ``(2i, 2i+1)`` together (AXLearn, GPT-J, RoFormer)."""
    rotate = _rotate_half if layout == "half_split" else _rotate_pairs
    cos, sin = cos[..., None, :], sin[..., None, :]
    return x * cos + rotate(x) * sin
