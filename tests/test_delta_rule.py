"""The gated delta rule against references that share no code with it.

A NumPy float64 recurrence of the published equations and its hand-derived adjoint (the backward recurrence) check the
chunked form's outputs, final state and gradients, resets included; transformers' torch functions check the same
numbers and their autograd gradients; the rest checks what the equations imply: the token-by-token form and decoding
one token at a time agree with one chunked call, a reset is the same as running the documents apart, an identity
step (``g = 0, beta = 0``) changes nothing, and the memory of the backward pass grows linearly with the length.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from eqmoe.nn.delta_rule import chunked_delta_rule, recurrent_delta_rule

TOL = 1e-5
NAMES = ("q", "k", "v", "g", "beta", "initial_state")

chunked = jax.jit(chunked_delta_rule, static_argnames="chunk_size")
recurrent = jax.jit(recurrent_delta_rule)


def _inputs(seed: int, batch: int, seq: int, heads: int, k_dim: int, v_dim: int, *, scale: bool = True) -> dict:
    """Random float64 inputs as a Qwen3-Next layer makes them: unit q and k (q scaled), g < 0, beta in (0, 1)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, seq, heads, k_dim))
    k = rng.normal(size=(batch, seq, heads, k_dim))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return dict(
        q=q * k_dim**-0.5 if scale else q,
        k=k,
        v=rng.normal(size=(batch, seq, heads, v_dim)),
        g=-rng.uniform(0.0, 1.5, size=(batch, seq, heads)),
        beta=rng.uniform(0.0, 1.0, size=(batch, seq, heads)),
        initial_state=rng.normal(size=(batch, heads, k_dim, v_dim)),
    )


def _resets(batch: int, seq: int, positions: list[list[int]]) -> np.ndarray:
    resets = np.zeros((batch, seq), bool)
    for row, where in enumerate(positions):
        resets[row, where] = True
    return resets


def _jax(inputs: dict) -> dict:
    return {name: jnp.asarray(x, jnp.float32) for name, x in inputs.items()}


def _close(got, want, tol: float = TOL, what: str = ""):
    """Equal to ``tol`` relative to each entry and to the largest entry (a float32 sum of many terms)."""
    want = np.asarray(want, np.float64)
    np.testing.assert_allclose(
        np.asarray(got, np.float64), want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()), err_msg=what
    )


def _numpy_forward(q, k, v, g, beta, initial_state, resets):
    """The published recurrence, token by token in float64; also what the adjoint needs of each step."""
    state = np.array(initial_state, np.float64)
    out = np.zeros(v.shape)
    steps = []
    for t in range(q.shape[1]):
        kept = np.where(resets[:, t, None, None, None], 0.0, state)
        decayed = kept * np.exp(g[:, t])[..., None, None]
        read = np.einsum("bhkv,bhk->bhv", decayed, k[:, t])
        delta = beta[:, t, :, None] * (v[:, t] - read)
        state = decayed + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = np.einsum("bhkv,bhk->bhv", state, q[:, t])
        steps.append((decayed, state, read, delta))
    return out, state, steps


def _numpy_gradients(q, k, v, g, beta, initial_state, resets, w_out, w_state):
    """Gradients of ``sum(o * w_out) + sum(S_final * w_state)`` by the adjoint recurrence, derived by hand:

    ``o_t = S_t^T q_t``; ``S_t = D_t + k_t delta_t^T``; ``delta_t = beta_t (v_t - r_t)``; ``r_t = D_t^T k_t``;
    ``D_t = exp(g_t) m_t S_{t-1}`` with ``m_t = 0`` at a reset, else 1. Walking back with ``dS = dL/dS_t``.
    """
    _, _, steps = _numpy_forward(q, k, v, g, beta, initial_state, resets)
    grads = {name: np.zeros(np.shape(x)) for name, x in zip(NAMES, (q, k, v, g, beta, initial_state), strict=True)}
    d_state = np.array(w_state, np.float64)
    for t in reversed(range(q.shape[1])):
        decayed, state, read, delta = steps[t]
        grads["q"][:, t] = np.einsum("bhkv,bhv->bhk", state, w_out[:, t])
        d_state = d_state + q[:, t, :, :, None] * w_out[:, t, :, None, :]
        d_delta = np.einsum("bhkv,bhk->bhv", d_state, k[:, t])
        d_read = -beta[:, t, :, None] * d_delta
        grads["v"][:, t] = beta[:, t, :, None] * d_delta
        grads["beta"][:, t] = np.sum(d_delta * (v[:, t] - read), axis=-1)
        grads["k"][:, t] = np.einsum("bhkv,bhv->bhk", d_state, delta) + np.einsum("bhkv,bhv->bhk", decayed, d_read)
        d_decayed = d_state + k[:, t, :, :, None] * d_read[:, :, None, :]
        grads["g"][:, t] = np.sum(d_decayed * decayed, axis=(-2, -1))
        d_state = np.where(resets[:, t, None, None, None], 0.0, np.exp(g[:, t])[..., None, None] * d_decayed)
    grads["initial_state"] = d_state
    return grads


# Resets inside chunks, on chunk boundaries (16, 32, 64, 128), two in one chunk, and at the first token (which drops
# the initial state).
RESETS = {
    (37, 16): [[5, 9, 16, 23], [0, 32]],
    (130, 64): [[40, 64, 100, 128], [0, 3, 70]],
}


@pytest.mark.parametrize("seq,chunk,with_resets", [(37, 16, False), (37, 16, True), (130, 64, True), (130, 64, False)])
def test_chunked_matches_numpy_recurrence(seq, chunk, with_resets):
    inputs = _inputs(0, 2, seq, 3, 16, 12)
    resets = _resets(2, seq, RESETS[seq, chunk] if with_resets else [])
    want_out, want_state, _ = _numpy_forward(**inputs, resets=resets)
    x = _jax(inputs)
    out, state = chunked(**x, resets=jnp.asarray(resets), chunk_size=chunk)
    assert out.shape == want_out.shape and out.dtype == jnp.float32 and state.dtype == jnp.float32
    _close(out, want_out, what="outputs")
    _close(state, want_state, what="final state")


def test_defaults_and_dtypes():
    """No resets and no initial state mean one document from zeros; outputs take v's dtype, the state is float32."""
    inputs = _inputs(1, 2, 21, 2, 8, 8)
    want_out, want_state, _ = _numpy_forward(
        **{**inputs, "initial_state": np.zeros((2, 2, 8, 8))}, resets=np.zeros((2, 21), bool)
    )
    x = _jax(inputs)
    del x["initial_state"]
    for fn in (chunked_delta_rule, recurrent_delta_rule):
        out, state = fn(**x)
        _close(out, want_out, what=fn.__name__)
        _close(state, want_state, what=fn.__name__)
        out, state = fn(**{**x, "v": x["v"].astype(jnp.bfloat16)})
        assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
        _close(out, want_out, tol=3e-2, what=f"{fn.__name__} bfloat16")


def _loss(fn, **kwargs):
    def loss(x, w_out, w_state, resets):
        out, state = fn(**x, resets=resets, **kwargs)
        return jnp.sum(out * w_out) + jnp.sum(state * w_state)

    return loss


@pytest.mark.parametrize(
    "form,with_resets", [("chunked", False), ("chunked", True), ("recurrent", True)], ids=lambda x: str(x)
)
def test_gradients_match_numpy_adjoint(form, with_resets):
    seq, chunk = 37, 16
    inputs = _inputs(2, 2, seq, 2, 8, 12)
    resets = _resets(2, seq, RESETS[seq, chunk] if with_resets else [])
    rng = np.random.default_rng(3)
    w_out, w_state = rng.normal(size=inputs["v"].shape), rng.normal(size=inputs["initial_state"].shape)
    want = _numpy_gradients(**inputs, resets=resets, w_out=w_out, w_state=w_state)
    loss = _loss(chunked_delta_rule, chunk_size=chunk) if form == "chunked" else _loss(recurrent_delta_rule)
    got = jax.jit(jax.grad(loss))(
        _jax(inputs), jnp.asarray(w_out, jnp.float32), jnp.asarray(w_state, jnp.float32), jnp.asarray(resets)
    )
    for name in NAMES:
        assert np.abs(want[name]).max() > 1e-2, name  # every gradient is exercised
        _close(got[name], want[name], what=name)
    if with_resets:  # a reset at the first token of row 1 cuts the initial state off from everything
        np.testing.assert_array_equal(np.asarray(got["initial_state"][1]), 0.0)


@pytest.mark.parametrize("k_heads,v_heads", [(2, 2), (1, 3)])
def test_matches_transformers(k_heads, v_heads):
    """Outputs, final state and autograd gradients of transformers' chunked and token-by-token torch functions.

    They scale q by ``k_dim ** -0.5`` themselves and repeat each q/k head over ``v_heads // k_heads`` value heads;
    the JAX side does both in the differentiated function, so gradients are of the same inputs.
    """
    batch, seq, k_dim, v_dim, chunk = 2, 37, 8, 12, 16
    qk = _inputs(4, batch, seq, k_heads, k_dim, v_dim, scale=False)
    vg = _inputs(5, batch, seq, v_heads, k_dim, v_dim)
    inputs = dict(q=qk["q"], k=qk["k"], v=vg["v"], g=vg["g"], beta=vg["beta"], initial_state=vg["initial_state"])
    rng = np.random.default_rng(6)
    w_out, w_state = rng.normal(size=inputs["v"].shape), rng.normal(size=inputs["initial_state"].shape)

    def ours(x):
        q = jnp.repeat(x["q"] * k_dim**-0.5, v_heads // k_heads, axis=2)
        k = jnp.repeat(x["k"], v_heads // k_heads, axis=2)
        out, state = chunked_delta_rule(
            q, k, x["v"], x["g"], x["beta"], initial_state=x["initial_state"], chunk_size=chunk
        )
        return jnp.sum(out * w_out) + jnp.sum(state * w_state), (out, state)

    (_, (out, state)), grads = jax.jit(jax.value_and_grad(ours, has_aux=True))(_jax(inputs))

    for name, fn, kwargs in [
        ("chunked", torch_chunk_gated_delta_rule, dict(chunk_size=chunk)),
        ("recurrent", torch_recurrent_gated_delta_rule, {}),
    ]:
        tensors = {name: torch.tensor(x, dtype=torch.float32, requires_grad=True) for name, x in inputs.items()}
        t_out, t_state = fn(
            tensors["q"], tensors["k"], tensors["v"], tensors["g"], tensors["beta"],
            initial_state=tensors["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=False, **kwargs,
        )  # fmt: skip
        loss = (t_out * torch.tensor(w_out, dtype=torch.float32)).sum() + (
            t_state * torch.tensor(w_state, dtype=torch.float32)
        ).sum()
        loss.backward()
        _close(out, t_out.detach().numpy(), what=f"{name} outputs")
        _close(state, t_state.detach().numpy(), what=f"{name} final state")
        for key in NAMES:
            _close(grads[key], tensors[key].grad.numpy(), what=f"{name} d{key}")


def test_recurrent_and_decoding_match_chunked():
    """The token-by-token form, and decoding one token per call from the last call's state, give one chunked call."""
    seq, chunk = 37, 16
    inputs = _jax(_inputs(7, 2, seq, 2, 8, 12))
    resets = jnp.asarray(_resets(2, seq, RESETS[seq, chunk]))
    want_out, want_state = chunked(**inputs, resets=resets, chunk_size=chunk)

    out, state = recurrent(**inputs, resets=resets)
    _close(out, want_out, what="recurrent outputs")
    _close(state, want_state, what="recurrent state")

    for fn in (recurrent, lambda **x: chunked(**x, chunk_size=chunk)):
        state, outs = inputs["initial_state"], []
        for t in range(seq):
            step = {name: x[:, t : t + 1] for name, x in inputs.items() if name != "initial_state"}
            out, state = fn(**step, resets=resets[:, t : t + 1], initial_state=state)
            outs.append(out)
        _close(jnp.concatenate(outs, axis=1), want_out, what="decoded outputs")
        _close(state, want_state, what="decoded state")


@pytest.mark.parametrize("first", [20, 32])  # B starts inside a chunk / on a chunk boundary
def test_reset_runs_documents_apart(first):
    """A row of document A then document B (reset at B's first token): A's tokens are A alone from the initial
    state, B's are B alone from zeros, and the final state is B's."""
    seq, chunk = 45, 16
    inputs = _jax(_inputs(8, 2, seq, 2, 8, 12))
    resets = jnp.asarray(_resets(2, seq, [[first], [first]]))
    out, state = chunked(**inputs, resets=resets, chunk_size=chunk)

    a = {name: x[:, :first] for name, x in inputs.items() if name != "initial_state"}
    b = {name: x[:, first:] for name, x in inputs.items() if name != "initial_state"}
    a_out, _ = chunked(**a, initial_state=inputs["initial_state"], chunk_size=chunk)
    b_out, b_state = chunked(**b, chunk_size=chunk)
    _close(out[:, :first], a_out, what="document A")
    _close(out[:, first:], b_out, what="document B")
    _close(state, b_state, what="final state")
    joined, _ = chunked(**inputs, chunk_size=chunk)  # without the reset, A's state reaches B
    assert np.abs(np.asarray(joined[:, first:] - b_out)).max() > 1e-2


def test_identity_steps_change_nothing():
    """Tokens with g = 0 and beta = 0 (padding) inserted anywhere, across a chunk boundary and at the end, leave the
    other tokens' outputs and the final state as they were, whatever their q, k and v."""
    seq, chunk = 30, 16
    inputs = _jax(_inputs(9, 2, seq, 2, 8, 12))
    resets = jnp.asarray(_resets(2, seq, [[11], [0, 17]]))
    want_out, want_state = chunked(**inputs, resets=resets, chunk_size=chunk)

    inserted = [0, 7, 7, 14, 15, 16, 30, 30]  # positions in the original sequence before which one pad goes
    keep = np.asarray([i + int(np.sum(np.asarray(inserted) <= i)) for i in range(seq)])
    total = seq + len(inserted)
    noise = _jax(_inputs(10, 2, total, 2, 8, 12))
    padded = {name: x for name, x in noise.items() if name != "initial_state"}
    padded["g"] = jnp.zeros_like(padded["g"])
    padded["beta"] = jnp.zeros_like(padded["beta"])
    padded_resets = jnp.zeros((2, total), bool)
    for name in padded:
        padded[name] = padded[name].at[:, keep].set(inputs[name])
    padded_resets = padded_resets.at[:, keep].set(resets)
    out, state = chunked(**padded, resets=padded_resets, initial_state=inputs["initial_state"], chunk_size=chunk)
    _close(out[:, keep], want_out, what="outputs")
    _close(state, want_state, what="final state")
    # The padded call is a real test: a non-zero beta on one pad moves the outputs.
    pads = np.setdiff1d(np.arange(total), keep)
    assert len(pads) == len(inserted)
    moved, _ = chunked(
        **{**padded, "beta": padded["beta"].at[:, pads[1]].set(0.5)},
        resets=padded_resets,
        initial_state=inputs["initial_state"],
        chunk_size=chunk,
    )
    assert np.abs(np.asarray(moved[:, keep] - want_out)).max() > 1e-3


def test_backward_memory_is_linear_in_length():
    """The compiled gradient's temporary memory for 4x the tokens is at most 4.5x (a [seq, seq] or per-token state
    would make it 16x or far more), and at most 3x the inputs' bytes: only chunk-boundary states and copies of the
    inputs are kept, not each chunk's [chunk, chunk] matrices (without ``jax.checkpoint`` it is over 10x)."""

    def memory(seq: int):
        x = _jax(_inputs(11, 1, seq, 2, 16, 32))
        del x["initial_state"]

        def loss(x):
            out, state = chunked_delta_rule(**x, chunk_size=64)
            return jnp.sum(out**2) + jnp.sum(state**2)

        return jax.jit(jax.grad(loss)).lower(x).compile().memory_analysis()

    start = time.perf_counter()
    short, long = memory(1024), memory(4096)
    ratio = long.temp_size_in_bytes / short.temp_size_in_bytes
    print(
        f"backward temp bytes: seq 1024 {short.temp_size_in_bytes}, seq 4096 {long.temp_size_in_bytes} (ratio "
        f"{ratio:.2f}); inputs at 4096 {long.argument_size_in_bytes} ({time.perf_counter() - start:.1f} s)"
    )
    assert ratio <= 4.5
    assert long.temp_size_in_bytes <= 3 * long.argument_size_in_bytes
