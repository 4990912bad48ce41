"""Parameter initialisers shared by the building blocks."""

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray


def normal(key: PRNGKeyArray, shape: tuple[int, ...], std: float, dtype: DTypeLike) -> Float[Array, "..."]:
    """Weights drawn from N(0, std^2), the Hugging Face ``initializer_range`` convention."""
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
