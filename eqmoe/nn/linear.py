"""Weights that carry their own bias and low-rank adapter: every matrix of the model is one of these.

A :class:`Linear` is ``y = x @ W + b + s * (x @ A) @ B``: the weight with its role and logical axes (declared per
instance, since the same kind of matrix is an attention projection in one layer and an expert's in another), an
optional bias and an optional LoRA adapter (:class:`LowRank`, added by :func:`eqmoe.lora.add_lora`). Layers call
it; kernels and dispatch backends call the products of :class:`ExpertLinear` (stacked expert matrices) and never
learn that biases or adapters exist.

Shapes: a weight is ``[*lead, *in, *out]`` (``lead_axes``: ``("experts",)`` for stacked experts; ``in_axes`` and
``out_axes`` name the rest), its bias ``[*lead, *out]``, an adapter's ``A`` ``[*lead, *in, rank]`` and ``B``
``[*lead, rank, *out]``, so everything shards like its weight. Inputs arrive flat, ``[tokens, prod(in)]``, and
outputs leave flat, ``[tokens, prod(out)]``. Stacked copies (a scanned segment's ``layers`` axis) add leading
axes, which the products never see: they run inside the scan.

A frozen weight may be held as stored in block-FP8 (:class:`~eqmoe.nn.fp8.BlockFP8Weight`, the base of a LoRA model
read with ``hf.load(..., keep_fp8=True)``): :meth:`Linear.matrix` dequantizes it, and each product then runs under
``jax.checkpoint`` so that the backward pass recomputes the dequantized matrix from the FP8 bytes instead of saving
it for every layer. Code that wants the weight as an array asks :meth:`Linear.weight_array`, never ``.weight``.
"""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqmoe.nn import fp8, megablox
from eqmoe.nn._init import Init
from eqmoe.nn.fp8 import BlockFP8Weight
from eqmoe.params import Layer, Role


def _cast(x: Array, dtype) -> Array:
    return x if x.dtype == dtype else x.astype(dtype)


def _matrices(x: Array, inner: int, outer: int) -> Array:
    """``x`` with its last ``inner`` axes merged into one and the ``outer`` axes after them into another."""
    keep = x.ndim - inner - outer
    return x.reshape(*x.shape[:keep], math.prod(x.shape[keep : keep + inner]), math.prod(x.shape[keep + inner :]))


def _dequantized_in_backward(product):
    """``product`` of a matrix run under ``jax.checkpoint`` when its weight is block-FP8: the dequantized matrix is
    then an intermediate of the product, recomputed in the backward pass, not a residual kept per layer."""

    @functools.wraps(product)
    def run(self, *args, **kwargs):
        if isinstance(self.weight, BlockFP8Weight):
            return jax.checkpoint(product)(self, *args, **kwargs)
        return product(self, *args, **kwargs)

    return run


def _assemble(cls: type, **fields) -> Layer:
    """An instance of the module ``cls`` holding ``fields`` as they are (no ``__init__``)."""
    module = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(module, name, value)
    return module


class LowRank(Layer):
    """A LoRA adapter ``scale * A @ B`` beside a frozen weight, never merged while training.

    ``dropout`` (PEFT's ``lora_dropout``) drops the adapter's inputs while training: ``W x + s B A dropout(x)``."""

    a: Float[Array, "..."]
    b: Float[Array, "..."]
    scale: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True)
    lead_axes: tuple[str, ...] = eqx.field(static=True)
    in_axes: tuple[str, ...] = eqx.field(static=True)
    out_axes: tuple[str, ...] = eqx.field(static=True)

    def declared(self) -> dict[str, tuple[Role, tuple[str, ...]]]:
        return {
            "a": (Role.ADAPTER, (*self.lead_axes, *self.in_axes, "lora_rank")),
            "b": (Role.ADAPTER, (*self.lead_axes, "lora_rank", *self.out_axes)),
        }

    @classmethod
    def holding(cls, a: Array, b: Array, scale: float = 1.0) -> "LowRank":
        """An adapter of these matrices ``A [fan_in, rank]``, ``B [rank, fan_out]`` (inside a kernel: a product to
        differentiate, not a parameter to declare)."""
        return _assemble(cls, a=a, b=b, scale=scale, dropout=0.0, lead_axes=(), in_axes=("in",), out_axes=("out",))

    @property
    def rank(self) -> int:
        return self.a.shape[-1]

    def matrices(self) -> tuple[Array, Array]:
        """``(A, B)`` as ``[..., fan_in, rank]`` and ``[..., rank, fan_out]`` (leading axes kept)."""
        return _matrices(self.a, len(self.in_axes), 1), _matrices(self.b, 1, len(self.out_axes))

    def delta(self) -> Float[Array, "..."]:
        """``scale * A @ B`` in its weight's shape, in float32 (merging, reference checks)."""
        a, b = self.matrices()
        product = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32)) * self.scale
        return product.reshape(*self.a.shape[:-1], *self.b.shape[self.b.ndim - len(self.out_axes) :])


class Linear(Layer):
    """``x @ W (+ b) (+ s * dropout(x) @ A @ B)``: one weight with its bias and adapter.

    **Arguments** of ``__init__``:

    - `in_shape`, `out_shape`: the weight's input and output dimensions (``(embed,)``, ``(heads, head_dim)``).
    - `role`: what the weight is (:class:`Role`); its bias, with ``bias=True``, is ``Role.BIAS``.
    - `in_axes`, `out_axes`: their logical axis names (sharding, adapters).
    - `init`, `key`: how it is drawn (fan-in: the product of ``in_shape``).
    """

    weight: Float[Array, "..."] | BlockFP8Weight
    bias: Float[Array, "..."] | None
    adapter: LowRank | None
    role: Role = eqx.field(static=True)
    in_axes: tuple[str, ...] = eqx.field(static=True)
    out_axes: tuple[str, ...] = eqx.field(static=True)
    lead_axes: tuple[str, ...] = eqx.field(static=True, default=())

    def __init__(
        self,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        *,
        role: Role,
        in_axes: tuple[str, ...],
        out_axes: tuple[str, ...],
        init: Init,
        key: PRNGKeyArray,
        bias: bool = False,
        lead: tuple[tuple[str, int], ...] = (),
    ):
        sizes = tuple(size for _, size in lead)
        self.weight = init.weight(key, (*sizes, *in_shape, *out_shape), fan_in=math.prod(in_shape))
        self.bias = jnp.zeros((*sizes, *out_shape), init.dtype) if bias else None
        self.adapter = None
        self.role = role
        self.in_axes = tuple(in_axes)
        self.out_axes = tuple(out_axes)
        self.lead_axes = tuple(name for name, _ in lead)

    @classmethod
    def holding(
        cls, weight: Array, bias: Array | None = None, adapter: LowRank | None = None, *, role: Role
    ) -> "Linear":
        """A product of these arrays, ``weight [fan_in, fan_out]`` (inside a kernel: a product to differentiate,
        not a parameter to declare or initialise)."""
        fields = dict(weight=weight, bias=bias, adapter=adapter, role=role, in_axes=("in",), out_axes=("out",))
        return _assemble(Linear, **fields, lead_axes=())

    def declared(self) -> dict[str, tuple[Role, tuple[str, ...]]]:
        return {
            "weight": (self.role, (*self.lead_axes, *self.in_axes, *self.out_axes)),
            "bias": (Role.BIAS, (*self.lead_axes, *self.out_axes)),
        }

    def weight_array(self, dtype=None) -> Float[Array, "..."]:
        """The weight as an array in its own layout ``[*lead, *in, *out]``, in ``dtype`` (default: as held; a block-FP8
        weight dequantized, in float32 by default)."""
        if isinstance(self.weight, BlockFP8Weight):
            return self.weight.dequantize(jnp.float32 if dtype is None else dtype)
        return self.weight if dtype is None else _cast(self.weight, dtype)

    def matrix(self, dtype=None) -> Float[Array, "*lead fan_in fan_out"]:
        """The weight as a ``[fan_in, fan_out]`` matrix (leading axes kept), in ``dtype`` as :meth:`weight_array`."""
        return _matrices(self.weight_array(dtype), len(self.in_axes), len(self.out_axes))

    def flat_bias(self) -> Float[Array, "*lead fan_out"] | None:
        if self.bias is None:
            return None
        out = len(self.out_axes)
        return self.bias.reshape(*self.bias.shape[: self.bias.ndim - out], -1)

    @_dequantized_in_backward
    def __call__(
        self, x: Float[Array, "tokens fan_in"], key: PRNGKeyArray | None = None
    ) -> Float[Array, "tokens fan_out"]:
        """``key``: the randomness of training-time adapter dropout (``None``: none, as in evaluation)."""
        y = x @ self.matrix(x.dtype)
        if self.bias is not None:
            y = y + _cast(self.flat_bias(), y.dtype)
        if self.adapter is not None:
            a, b = self.adapter.matrices()
            rate = self.adapter.dropout
            if key is not None and rate > 0:
                keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
                x = jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros_like(x))
            y = y + ((x @ _cast(a, x.dtype)) @ _cast(b, x.dtype)) * jnp.asarray(self.adapter.scale, x.dtype)
        return y


class ExpertLinear(Linear):
    """One matrix per routed expert, stacked on a leading ``experts`` axis (weight, bias and adapter alike).

    The dispatch backends use its products; a slice of it taken inside a ``lax.scan`` over the experts (as
    :mod:`eqmoe.nn.grouped` takes one) is one expert's matrix and is called like a :class:`Linear`."""

    def __init__(
        self,
        num_experts: int,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        *,
        role: Role,
        in_axes: tuple[str, ...],
        out_axes: tuple[str, ...],
        init: Init,
        key: PRNGKeyArray,
        bias: bool = False,
    ):
        super().__init__(
            in_shape,
            out_shape,
            role=role,
            in_axes=in_axes,
            out_axes=out_axes,
            init=init,
            key=key,
            bias=bias,
            lead=(("experts", num_experts),),
        )

    def _adapter(self, dtype) -> tuple[Array, Array]:
        """``(A, s B)`` as ``[experts, fan_in, rank]`` and ``[experts, rank, fan_out]`` in ``dtype``."""
        a, b = self.adapter.matrices()
        return _cast(a, dtype), _cast(b, dtype) * jnp.asarray(self.adapter.scale, dtype)

    @_dequantized_in_backward
    def shared_input(self, x: Float[Array, "tokens fan_in"]) -> Float[Array, "experts tokens fan_out"]:
        """Every expert's product with the same rows (the dense reference backend)."""
        y = jnp.einsum("td,edf->etf", x, self.matrix(x.dtype))
        if self.bias is not None:
            y = y + _cast(self.flat_bias()[:, None], y.dtype)
        if self.adapter is not None:
            a, b = self._adapter(x.dtype)
            y = y + jnp.einsum("etr,erf->etf", jnp.einsum("td,edr->etr", x, a), b)
        return y

    @_dequantized_in_backward
    def per_expert(self, x: Float[Array, "experts rows fan_in"]) -> Float[Array, "experts rows fan_out"]:
        """Expert ``e``'s product with its own rows ``x[e]`` (capacity buffers)."""
        y = jnp.einsum("etd,edf->etf", x, self.matrix(x.dtype))
        if self.bias is not None:
            y = y + _cast(self.flat_bias()[:, None], y.dtype)
        if self.adapter is not None:
            a, b = self._adapter(x.dtype)
            y = y + jnp.einsum("etr,erf->etf", jnp.einsum("etd,edr->etr", x, a), b)
        return y

    @_dequantized_in_backward
    def ragged(
        self, x: Float[Array, "rows fan_in"], group_sizes: Int[Array, " experts"]
    ) -> Float[Array, "rows fan_out"]:
        """Rows sorted by expert, the first ``group_sizes[0]`` rows expert 0's and so on
        (``jax.lax.ragged_dot``); rows past the last group give zeros."""
        return self._grouped_extras(x, jax.lax.ragged_dot(x, self.matrix(x.dtype), group_sizes), group_sizes)

    @_dequantized_in_backward
    def grouped(
        self, x: Float[Array, "rows fan_in"], group_sizes: Int[Array, " experts"], tiles: megablox.Tiles
    ) -> Float[Array, "rows fan_out"]:
        """:meth:`ragged`'s product by the TPU's grouped-matmul kernel in ``tiles`` (:mod:`eqmoe.nn.megablox`; the
        rows a whole number of its row tiles); an adapter's rank-``r`` products stay ragged dots."""
        return self._grouped_extras(x, megablox.gmm(x, self.matrix(x.dtype), group_sizes, tiles), group_sizes)

    def _grouped_extras(self, x: Array, y: Array, group_sizes: Array) -> Array:
        """``y``, the rows' product with their groups' matrices, plus their groups' biases and adapters."""
        if self.bias is not None:
            y = y + _rows_of_groups(_cast(self.flat_bias(), y.dtype), group_sizes, x.shape[0])
        if self.adapter is not None:
            a, b = self._adapter(x.dtype)
            y = y + jax.lax.ragged_dot(jax.lax.ragged_dot(x, a, group_sizes), b, group_sizes)
        return y


def _rows_of_groups(values: Float[Array, "experts width"], group_sizes: Int[Array, " experts"], rows: int) -> Array:
    """``values[e]`` on every row of group ``e``, zeros past the last group."""
    group = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right")
    inside = group < values.shape[0]
    return jnp.where(inside[:, None], values[jnp.minimum(group, values.shape[0] - 1)], 0)


def block_fp8_like(model, block: tuple[int, int] = (128, 128), roles=None):
    """``model`` with every matrix whose role is in ``roles`` (default: attention, dense-FFN and expert matrices, the
    ones DeepSeek-V3 publishes in block-FP8) held as a :class:`BlockFP8Weight` of ``block = (b_in, b_out)`` blocks,
    values zero and scales one: the layout a block-FP8 base loads into, for planning (under ``eqx.filter_eval_shape``
    nothing is allocated). Matrices that carry an adapter keep it."""
    roles = (Role.ATTENTION, Role.MLP, Role.EXPERT) if roles is None else roles

    def hold(node):
        if not isinstance(node, Linear) or node.role not in roles or isinstance(node.weight, BlockFP8Weight):
            return node
        in_dims, out_dims = len(node.in_axes), len(node.out_axes)
        weight = BlockFP8Weight(
            values=jnp.zeros(node.weight.shape, fp8.FP8),
            scales=jnp.ones(fp8.grid(node.weight.shape, block, in_dims, out_dims), jnp.float32),
            block=block,
            in_dims=in_dims,
            out_dims=out_dims,
        )
        return eqx.tree_at(lambda linear: linear.weight, node, weight)

    return jax.tree.map(hold, model, is_leaf=lambda node: isinstance(node, Linear))
