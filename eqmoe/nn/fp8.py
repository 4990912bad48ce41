"""Block-FP8 weights held as stored (DeepSeek-V3's published layout) and dequantized where they are used.

A :class:`BlockFP8Weight` stands in a :class:`~eqmoe.nn.linear.Linear`'s ``weight`` field: ``values``, float8_e4m3fn
in the weight's own layout ``[*lead, *in, *out]`` (so it shards as the weight does), and ``scales``, float32, one per
block of the flattened ``[fan_in, fan_out]`` matrix, ``[*lead, ceil(fan_in / b_in), ceil(fan_out / b_out)]``, the
blocks at the bottom and right edges partial where ``b_in`` or ``b_out`` does not divide the matrix:

    W[..., i, j] = float32(values[..., i, j]) * scales[..., i // b_in, j // b_out]

(a checkpoint's ``weight_scale_inv`` of a torch ``[out, in]`` tensor in ``[b_out, b_in]`` blocks, transposed). The
base then takes one byte per parameter plus a float32 per block. Such a weight is never trained: it is the frozen base
of a LoRA model. :class:`~eqmoe.nn.linear.Linear` dequantizes it in each product, inside the product's own
``jax.checkpoint``, so that the backward pass recomputes the dequantized matrix from the FP8 bytes instead of keeping
it: inside a layer scan only one layer's base is ever dequantized at a time, in the forward and in the backward pass.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

FP8 = jnp.float8_e4m3fn
BLOCKS = "fp8_blocks"  # the logical axis of a block grid dimension that spans several weight axes (replicated)


class BlockFP8Weight(eqx.Module):
    """A block-FP8 weight: float8_e4m3fn ``values`` in the weight's layout and float32 ``scales``, one per
    ``block = (b_in, b_out)`` block of the flattened ``[fan_in, fan_out]`` matrix (see the module docstring).
    ``in_dims`` and ``out_dims`` count the weight's input and output axes (the leading ones are stacked copies:
    layers, experts)."""

    values: Float[Array, "..."]
    scales: Float[Array, "..."]
    block: tuple[int, int] = eqx.field(static=True)
    in_dims: int = eqx.field(static=True, default=1)
    out_dims: int = eqx.field(static=True, default=1)

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape (the ``values``')."""
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held: the values' one per parameter and the scales'."""
        return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in (self.values, self.scales))

    def parameter_axes(self, axes: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
        """``{field: logical axes}`` when the weight's axes are ``axes`` (``[*lead, *in, *out]``): the values take
        them; the scales take the leading ones and, for each block grid dimension, the weight axis it runs along
        where there is one (so a weight split along that axis splits its scales alike) or :data:`BLOCKS`."""
        lead = axes[: len(axes) - self.in_dims - self.out_dims]
        inputs, outputs = axes[len(lead) : len(lead) + self.in_dims], axes[len(lead) + self.in_dims :]
        blocks = tuple(names[0] if len(names) == 1 else BLOCKS for names in (inputs, outputs))
        return {"values": tuple(axes), "scales": (*lead, *blocks)}

    def dequantize(self, dtype=jnp.float32) -> Float[Array, "..."]:
        """The weight ``values * scale`` in its own shape, formed in float32 (as transformers dequantizes) and cast to
        ``dtype``."""
        shape = self.shape
        keep = len(shape) - self.in_dims - self.out_dims
        fan_in, fan_out = math.prod(shape[keep : keep + self.in_dims]), math.prod(shape[keep + self.in_dims :])
        matrix = self.values.reshape(*shape[:keep], fan_in, fan_out).astype(jnp.float32)
        scales = self.scales.astype(jnp.float32)
        scales = jnp.repeat(scales, self.block[0], axis=-2, total_repeat_length=scales.shape[-2] * self.block[0])
        scales = jnp.repeat(scales, self.block[1], axis=-1, total_repeat_length=scales.shape[-1] * self.block[1])
        weight = matrix * scales[..., :fan_in, :fan_out]
        return weight.astype(dtype).reshape(shape)

    def __getitem__(self, index) -> "BlockFP8Weight":
        """Stacked copies ``index`` (leading axes only: layers, experts), values and scales alike."""
        return jax.tree.map(lambda x: x[index], self)


def is_block_fp8(node) -> bool:
    return isinstance(node, BlockFP8Weight)


def grid(shape: tuple[int, ...], block: tuple[int, int], in_dims: int, out_dims: int) -> tuple[int, ...]:
    """The scales' shape of a weight of ``shape`` in ``block``\\ s (``[*lead, blocks in, blocks out]``)."""
    keep = len(shape) - in_dims - out_dims
    fan_in, fan_out = math.prod(shape[keep : keep + in_dims]), math.prod(shape[keep + in_dims :])
    return (*shape[:keep], -(-fan_in // block[0]), -(-fan_out // block[1]))


def dequantized(tree, dtype=jnp.float32):
    """``tree`` with every :class:`BlockFP8Weight` replaced by its dequantized weight in ``dtype``."""
    return jax.tree.map(lambda node: node.dequantize(dtype) if is_block_fp8(node) else node, tree, is_leaf=is_block_fp8)


def held_bytes(tree) -> tuple[int, int]:
    """``(weights, bytes)`` of the block-FP8 weights in ``tree`` (arrays or ``jax.ShapeDtypeStruct``)."""
    held = [node for node in jax.tree.leaves(tree, is_leaf=is_block_fp8) if is_block_fp8(node)]
    return sum(math.prod(node.shape) for node in held), sum(node.nbytes for node in held)
