"""LoRA adapters: a low-rank update ``scale * A @ B`` beside a frozen weight, never merged while training.

Each adapted layer holds its adapters in one optional field (``None`` without LoRA). A weight ``W`` of
shape ``in_dims + out_dims`` gets ``A: in_dims + [lora_rank]`` and ``B: [lora_rank] + out_dims``, so an
adapter is sharded over the mesh like its weight's input and output axes; ``B`` starts at zero, so an
adapted model computes exactly what its base does until it is trained. ``scale = alpha / rank``.
Routed experts get one adapter per expert (``[experts, ...]``), computed inside every dispatch backend.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from eqmoe.nn._params import Layer, Role, param


def low_rank(
    x: Float[Array, "tokens fan_in"], a: Float[Array, "*in rank"], b: Float[Array, "rank *out"], scale: float
) -> Float[Array, "tokens fan_out"]:
    """``scale * (x @ A) @ B`` with ``A`` and ``B`` flattened to matrices: the adapter's term of ``x @ W``."""
    rank = a.shape[-1]
    return ((x @ a.reshape(-1, rank).astype(x.dtype)) @ b.reshape(rank, -1).astype(x.dtype)) * jnp.asarray(
        scale, x.dtype
    )


def merged_weight(weight: Array, a: Array | None, b: Array | None, scale: float) -> Array:
    """``W + scale * A @ B`` in ``W``'s shape (``W`` when not adapted), for export and reference checks.
    Leading axes shared by all three (experts, stacked layers) are kept."""
    if a is None:
        return weight
    shared = a.ndim + b.ndim - 2 - weight.ndim
    lead, rank = a.shape[:shared], a.shape[-1]
    a = a.reshape(*lead, -1, rank).astype(jnp.float32)
    b = b.reshape(*lead, rank, -1).astype(jnp.float32)
    return (weight + scale * (a @ b).reshape(weight.shape)).astype(weight.dtype)


class ExpertAdapters(Layer):
    """Per-expert LoRA of the routed experts' ``w_gate``, ``w_up`` and ``w_down`` (any of them may be
    ``None``): expert ``e`` computes with ``W_e + scale * A_e @ B_e``."""

    gate_a: Float[Array, "experts embed lora_rank"] | None = param(Role.ADAPTER)
    gate_b: Float[Array, "experts lora_rank expert_mlp"] | None = param(Role.ADAPTER)
    up_a: Float[Array, "experts embed lora_rank"] | None = param(Role.ADAPTER)
    up_b: Float[Array, "experts lora_rank expert_mlp"] | None = param(Role.ADAPTER)
    down_a: Float[Array, "experts expert_mlp lora_rank"] | None = param(Role.ADAPTER)
    down_b: Float[Array, "experts lora_rank embed"] | None = param(Role.ADAPTER)
    scale: float = eqx.field(static=True)


class AttentionAdapters(Layer):
    """LoRA of the attention projections (any pair may be ``None``)."""

    q_a: Float[Array, "embed lora_rank"] | None = param(Role.ADAPTER)
    q_b: Float[Array, "lora_rank heads head_dim"] | None = param(Role.ADAPTER)
    k_a: Float[Array, "embed lora_rank"] | None = param(Role.ADAPTER)
    k_b: Float[Array, "lora_rank kv_heads head_dim"] | None = param(Role.ADAPTER)
    v_a: Float[Array, "embed lora_rank"] | None = param(Role.ADAPTER)
    v_b: Float[Array, "lora_rank kv_heads head_dim"] | None = param(Role.ADAPTER)
    o_a: Float[Array, "heads head_dim lora_rank"] | None = param(Role.ADAPTER)
    o_b: Float[Array, "lora_rank embed"] | None = param(Role.ADAPTER)
    scale: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True, default=0.0)


class MLPAdapters(Layer):
    """LoRA of a dense SwiGLU's matrices (any pair may be ``None``)."""

    gate_a: Float[Array, "embed lora_rank"] | None = param(Role.ADAPTER)
    gate_b: Float[Array, "lora_rank mlp"] | None = param(Role.ADAPTER)
    up_a: Float[Array, "embed lora_rank"] | None = param(Role.ADAPTER)
    up_b: Float[Array, "lora_rank mlp"] | None = param(Role.ADAPTER)
    down_a: Float[Array, "mlp lora_rank"] | None = param(Role.ADAPTER)
    down_b: Float[Array, "lora_rank embed"] | None = param(Role.ADAPTER)
    scale: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True, default=0.0)


class RouterAdapter(Layer):
    """LoRA of the router's gate."""

    a: Float[Array, "embed lora_rank"] = param(Role.ADAPTER)
    b: Float[Array, "lora_rank gates"] = param(Role.ADAPTER)
    scale: float = eqx.field(static=True)


_MATRICES = ("q", "k", "v", "o", "gate", "up", "down")


def adapted(
    x: Float[Array, "tokens fan_in"],
    weight: Array,
    adapters: Layer | None,
    name: str,
    key: PRNGKeyArray | None = None,
) -> Float[Array, "tokens fan_out"]:
    """``x @ W`` (``W`` flattened to a matrix) plus the adapter ``{name}_a``/``{name}_b`` when present. With a
    ``key`` and ``adapters.dropout > 0`` the adapter sees ``x`` through inverted dropout (PEFT's ``lora_dropout``:
    ``W x + s B A dropout(x)``), one mask per matrix; without a key (evaluation, generation) it sees ``x``."""
    out = x @ weight.reshape(x.shape[-1], -1)
    a = None if adapters is None else getattr(adapters, f"{name}_a")
    if a is None:
        return out
    rate = getattr(adapters, "dropout", 0.0)
    if key is not None and rate > 0:
        keep = jax.random.bernoulli(jax.random.fold_in(key, _MATRICES.index(name)), 1.0 - rate, x.shape)
        x = jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros_like(x))
    return out + low_rank(x, a, getattr(adapters, f"{name}_b"), adapters.scale)
