"""Grouped expert SwiGLU over row blocks sorted by expert, with a hand-written backward pass.

The rows arrive as ``[blocks, block_size, embed]``; every row of block ``n`` belongs to expert
``block_experts[n]``. A ``lax.scan`` over the blocks runs one ``[block_size, embed] x [embed, expert_dim]``
matmul per weight with that expert's weights read in place, so no ``[blocks, embed, expert_dim]`` copy
of the weights is ever made. Blocks at or past ``used_blocks`` are all padding and skipped.

Why a custom VJP: differentiating ``w[block_experts[n]]`` inside the scan makes JAX add a full
``[experts, embed, expert_dim]`` zero-padded gradient into the accumulator on every block. The backward
here is a second scan that adds each block's ``[embed, expert_dim]`` gradient into its expert's slice of
the accumulator in place.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def _silu_and_grad(gate: Array) -> tuple[Array, Array]:
    """``silu(gate)`` and its derivative, both evaluated in float32 (as :func:`eqmoe.nn.mlp.silu`)."""
    g = gate.astype(jnp.float32)
    sigmoid = jax.nn.sigmoid(g)
    return (g * sigmoid).astype(gate.dtype), (sigmoid * (1 + g * (1 - sigmoid))).astype(jnp.float32)


def _forward_block(x, w_gate, w_up, w_down):
    gate, up = x @ w_gate, x @ w_up
    silu_gate, _ = _silu_and_grad(gate)
    return (silu_gate * up) @ w_down, gate, up


@jax.custom_vjp
def grouped_swiglu(
    rows: Float[Array, "blocks block embed"],
    w_gate: Float[Array, "experts embed expert_dim"],
    w_up: Float[Array, "experts embed expert_dim"],
    w_down: Float[Array, "experts expert_dim embed"],
    block_experts: Int[Array, " blocks"],
    used_blocks: Int[Array, ""],
) -> Float[Array, "blocks block embed"]:
    """``down(silu(x @ gate) * (x @ up))`` of each row with its block's expert's weights."""
    return _grouped_forward(rows, w_gate, w_up, w_down, block_experts, used_blocks)[0]


def _grouped_forward(rows, w_gate, w_up, w_down, block_experts, used_blocks):
    block, expert_dim = rows.shape[1], w_gate.shape[2]

    def step(_, inputs):
        n, x, e = inputs

        def compute(x):
            return _forward_block(x, w_gate[e], w_up[e], w_down[e])

        def skip(x):
            zeros = jnp.zeros((block, expert_dim), x.dtype)
            return jnp.zeros_like(x), zeros, zeros

        return None, jax.lax.cond(n < used_blocks, compute, skip, x)

    index = jnp.arange(rows.shape[0])
    _, (out, gate, up) = jax.lax.scan(step, None, (index, rows, block_experts))
    return out, gate, up


def _grouped_fwd(rows, w_gate, w_up, w_down, block_experts, used_blocks):
    out, gate, up = _grouped_forward(rows, w_gate, w_up, w_down, block_experts, used_blocks)
    return out, (rows, gate, up, w_gate, w_up, w_down, block_experts, used_blocks)


def _grouped_bwd(residuals, d_out):
    rows, gate, up, w_gate, w_up, w_down, block_experts, used_blocks = residuals

    def step(grads, inputs):
        n, x, g, u, dy, e = inputs

        def compute(grads):
            d_gate_w, d_up_w, d_down_w = grads
            silu_gate, silu_grad = _silu_and_grad(g)
            hidden = silu_gate * u
            d_hidden = dy @ w_down[e].T
            d_g = (d_hidden.astype(jnp.float32) * u.astype(jnp.float32) * silu_grad).astype(g.dtype)
            d_u = d_hidden * silu_gate
            d_x = d_g @ w_gate[e].T + d_u @ w_up[e].T
            d_gate_w = d_gate_w.at[e].add(x.T @ d_g)
            d_up_w = d_up_w.at[e].add(x.T @ d_u)
            d_down_w = d_down_w.at[e].add(hidden.T @ dy)
            return (d_gate_w, d_up_w, d_down_w), d_x

        def skip(grads):
            return grads, jnp.zeros_like(x)

        return jax.lax.cond(n < used_blocks, compute, skip, grads)

    zeros = (jnp.zeros_like(w_gate), jnp.zeros_like(w_up), jnp.zeros_like(w_down))
    index = jnp.arange(rows.shape[0])
    (d_gate_w, d_up_w, d_down_w), d_rows = jax.lax.scan(step, zeros, (index, rows, gate, up, d_out, block_experts))
    return d_rows, d_gate_w, d_up_w, d_down_w, None, None


grouped_swiglu.defvjp(_grouped_fwd, _grouped_bwd)
