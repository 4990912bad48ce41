"""What the chip's Pallas kernels share."""

import contextlib

import jax
import jax.numpy as jnp


def operand_precision(dtype) -> contextlib.AbstractContextManager:
    """The matmul precision a kernel is traced at for operands of ``dtype``: the ambient one for float32, the chip's
    single pass for narrower ones. Mosaic refuses a float32 contraction of bfloat16 operands ("Bad lhs type"), which
    a program run at ``jax.default_matmul_precision("highest")`` would otherwise ask of it; one pass is exact there."""
    if jnp.dtype(dtype).itemsize >= 4:
        return contextlib.nullcontext()
    return jax.default_matmul_precision("default")


def at_operand_precision(function, dtype):
    """``function`` with its forward and backward pass both traced at :func:`operand_precision` ``(dtype)``: a kernel's
    own backward rule is traced when the gradient is taken, outside any ``with`` around the forward call. For float32
    operands, ``function`` itself."""
    if jnp.dtype(dtype).itemsize >= 4:
        return function

    @jax.custom_vjp
    def call(*args):
        with operand_precision(dtype):
            return function(*args)

    def forward(*args):
        with operand_precision(dtype):
            return jax.vjp(function, *args)

    def backward(pullback, grad):
        with operand_precision(dtype):
            return pullback(grad)

    call.defvjp(forward, backward)
    return call
