"""Parameter initialisation, one place for every block."""

import math
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray


@dataclass(frozen=True)
class Init:
    """How weights are drawn and stored.

    ``scheme="normal"``: N(0, std^2) for every weight (HF ``initializer_range``).
    ``scheme="fan_in"``: N(0, 1/fan_in) for weights and N(0, 1/embed_dim) for the embedding (AXLearn).
    """

    scheme: Literal["normal", "fan_in"]
    std: float
    dtype: jnp.dtype

    def weight(self, key: PRNGKeyArray, shape: tuple[int, ...], fan_in: int) -> Float[Array, "..."]:
        std = self.std if self.scheme == "normal" else 1.0 / math.sqrt(fan_in)
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(self.dtype)

    def embedding(self, key: PRNGKeyArray, vocab: int, dim: int) -> Float[Array, "vocab dim"]:
        return self.weight(key, (vocab, dim), fan_in=dim)

    def ones(self, dim: int) -> Float[Array, " dim"]:
        return jnp.ones((dim,), self.dtype)
