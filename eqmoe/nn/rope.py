"""Rotary position embedding (RoPE) in the half-split and interleaved layouts, with Hugging Face's
long-context frequency scalings (``linear``, ``yarn``, ``llama3``)."""

import math

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int

from eqmoe.rope_scaling import RopeScaling


def _periods(head_dim: int, theta: float) -> Float[np.ndarray, " half"]:
    """``theta^(2i / D)`` for ``i < D/2``, the float32 values torch's (near correctly rounded) float32 ``pow``
    gives: the power is taken in float64 and rounded once. Every table here follows transformers' float32
    operations in order, so each frequency is the float transformers computes and long positions turn through
    the same angles."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return (theta ** exponents.astype(np.float64)).astype(np.float32)


def _base_frequencies(head_dim: int, theta: float) -> Float[np.ndarray, " half"]:
    """Plain RoPE's ``theta^(-2i / D)``."""
    return (1.0 / _periods(head_dim, theta)).astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (Eq. 21 of the paper): ``0.1 * mscale * ln(scale) + 1``, 1 when not scaling up."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(scaling: RopeScaling, factor: float) -> float:
    """``attention_factor`` if given, else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both
    are set (and nonzero), else ``mscale(factor)``: the softmax sharpening YaRN restores at long range."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return float(_yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_correction_range(scaling: RopeScaling, head_dim: int, theta: float) -> tuple[int | float, int | float]:
    """The frequency indices ``(low, high)`` between which YaRN ramps from interpolating to keeping.

    Index ``d`` turns ``r`` times over the original context ``L`` where ``d = D ln(L / (2 pi r)) / (2 ln theta)``;
    ``low`` is the index turning ``beta_fast`` times (default 32), ``high`` the one turning ``beta_slow`` times
    (default 1), floored and ceiled unless ``truncate`` is false, clamped to ``[0, D - 1]``.
    """

    def index(rotations: float) -> float:
        original = scaling.original_max_position_embeddings
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = index(scaling.beta_fast or 32.0), index(scaling.beta_slow or 1.0)  # transformers: 0 means default too
    if scaling.truncate is None or scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def _yarn_factor(scaling: RopeScaling) -> float:
    if scaling.factor is None:  # DeepSeek-V3 style: the factor is the ratio of the two context lengths
        return scaling.max_position_embeddings / scaling.original_max_position_embeddings
    return scaling.factor


def yarn_softmax_scale(scaling: RopeScaling | None) -> float:
    """The factor multi-head latent attention folds into its softmax scale: ``mscale(factor, mscale_all_dim)^2``
    under scaled RoPE with ``mscale_all_dim`` set (transformers' ``yarn_apply_mscale``), else 1."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    return _yarn_mscale(_yarn_factor(scaling), scaling.mscale_all_dim) ** 2


def _yarn(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[Float[np.ndarray, " half"], float]:
    """``f_i (1 - e_i) / factor + f_i e_i`` with ``e_i = 1 - clip((i - low) / (high - low), 0, 1)``: frequencies
    that turn many times over the original context are kept (extrapolated), slow ones interpolated."""
    factor = _yarn_factor(scaling)
    periods = _periods(head_dim, theta)
    low, high = _yarn_correction_range(scaling, head_dim, theta)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)
    interpolated = (1.0 / (factor * periods)).astype(np.float32)
    inv_freq = interpolated * (1 - keep) + (1.0 / periods) * keep
    return inv_freq.astype(np.float32), _yarn_attention_factor(scaling, factor)


def _llama3(head_dim: int, theta: float, scaling: RopeScaling) -> Float[np.ndarray, " half"]:
    """Wavelengths ``2 pi / f`` longer than ``L / low_freq_factor`` are divided by ``factor``, shorter than
    ``L / high_freq_factor`` kept, and in between blended by ``s = (L / wavelength - low) / (high - low)``:
    ``(1 - s) f / factor + s f``, so only the slow rotations that never completed in training are stretched."""
    inv_freq = _base_frequencies(head_dim, theta)
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    original = scaling.original_max_position_embeddings
    wavelength = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelength > original / low, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = ((original / wavelength - low) / (high - low)).astype(np.float32)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < original / high) & ~(wavelength > original / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[Float[np.ndarray, " half"], float]:
    """The inverse frequency of every rotated pair and the factor cos and sin are multiplied by
    (transformers' ``ROPE_INIT_FUNCTIONS[rope_type](config)``; ``scaling=None`` is plain RoPE, factor 1).

    Computed on the host from the config alone, as float32 constants of the traced program.
    """
    if scaling is None:
        return _base_frequencies(head_dim, theta), 1.0
    if scaling.rope_type == "linear":  # interpolation: position p is rotated as p / factor
        return (_base_frequencies(head_dim, theta) / np.float32(scaling.factor)).astype(np.float32), 1.0
    if scaling.rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)
    return _llama3(head_dim, theta, scaling), 1.0


def rope_tables(
    positions: Int[Array, "*batch seq"],
    head_dim: int,
    theta: float,
    dtype: DTypeLike,
    layout: str = "half_split",
    scaling: RopeScaling | None = None,
) -> tuple[Float[Array, "*batch seq head_dim"], Float[Array, "*batch seq head_dim"]]:
    """Cosine and sine of every rotation angle, per dimension, in float32 then cast to ``dtype``.

    Angle ``p * f_i`` for the frequencies ``f_i`` of :func:`rope_frequencies` (``theta^(-2i / D)`` without
    ``scaling``, HF Qwen3MoeRotaryEmbedding); both tables are multiplied by its attention factor in float32,
    as transformers does, which scales every attention logit by its square. Half-split lays the angles out
    as ``concat(freqs, freqs)``; interleaved as ``(f0, f0, f1, f1, ...)``.
    """
    inv_freq, attention_factor = rope_frequencies(head_dim, theta, scaling)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([freqs, freqs], axis=-1) if layout == "half_split" else jnp.repeat(freqs, 2, axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.astype(dtype), sin.astype(dtype)


def _rotate_half(x: Float[Array, "... head_dim"]) -> Float[Array, "... head_dim"]:
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-second, first], axis=-1)


def _rotate_pairs(x: Float[Array, "... head_dim"]) -> Float[Array, "... head_dim"]:
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.stack([-odd, even], axis=-1).reshape(x.shape)


def apply_rope(
    x: Float[Array, "*batch seq heads head_dim"],
    cos: Float[Array, "*batch seq rotary_dim"],
    sin: Float[Array, "*batch seq rotary_dim"],
    layout: str = "half_split",
) -> Float[Array, "*batch seq heads head_dim"]:
    """``x * cos + rotate(x) * sin``: half-split rotates dimension ``i`` with ``i + D/2`` (HF "rotate_half",
    MaxText); interleaved rotates ``(2i, 2i+1)`` together (AXLearn, GPT-J, RoFormer).

    Tables narrower than the head (``rotary_dim < head_dim``: partial RoPE) rotate the first ``rotary_dim``
    dimensions as a head of that width and pass the rest through unchanged."""
    rotate = _rotate_half if layout == "half_split" else _rotate_pairs
    cos, sin = cos[..., None, :], sin[..., None, :]
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        rotated, passed = x[..., :rotary], x[..., rotary:]
        return jnp.concatenate([rotated * cos + rotate(rotated) * sin, passed], axis=-1)
    return x * cos + rotate(x) * sin
