"""The gated delta rule (Gated DeltaNet, the linear attention of Qwen3-Next / Qwen3.5) with document resets.

Per batch row and head the state ``S`` is a ``[k_dim, v_dim]`` float32 matrix and each token does::

    S_t = exp(g_t) * S_{t-1}                            decay (g_t <= 0)
    S_t = S_t + beta_t * k_t (v_t - S_t^T k_t)^T         delta rule: write only what S_t does not already predict
    o_t = S_t^T q_t

``q`` and ``k`` arrive L2-normalised and ``q`` already scaled by ``k_dim ** -0.5``; nothing here normalises.
These are the equations of transformers' ``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule``
(and of FLA's kernels), which this module reproduces to float32 rounding.

:func:`recurrent_delta_rule` runs them token by token (decoding). :func:`chunked_delta_rule` cuts the sequence into
chunks of ``C`` tokens and turns the ``C`` sequential rank-one updates of a chunk into matrix products (the WY / UT
form of DeltaNet). Writing ``delta_i = beta_i (v_i - S~_i^T k_i)`` for what token ``i`` writes (``S~_i`` its decayed
state), unrolling the recurrence from the chunk's incoming state ``S_0`` gives the lower triangular system::

    delta_i + sum_{j<i} beta_i D(j->i) (k_i . k_j) delta_j = beta_i v_i - beta_i D(0->i) S_0^T k_i

with ``D(j->i)`` the decay accumulated from token ``j`` to token ``i`` and ``D(0->i)`` the one from the chunk's
start. Inverting that unit lower triangular matrix once per chunk (``T``) gives ``u = T beta v`` and
``w = T beta D0 k``, so
``delta = u - w S_0``; then ``o = (D0 q) S_0 + (q k^T * D) delta`` and the outgoing state is
``D(0->end) S_0 + (D(->end) k)^T delta``. Only the last two need the state, so a scan over chunks carries it.

Document resets (``resets[b, t]``: token ``t`` starts a new packed document, the state before it is dropped) enter
the chunked form as masks, not as a huge negative decay: a cumulative sum that includes ``-1e9`` leaves nothing of a
neighbouring small decay in float32. A document index ``cumsum(resets)`` per position turns every decay factor into
"decay if both ends are in the same document, else exactly 0": pairs ``(i, j)`` of different documents do not
interact (in the UT system and in the intra-chunk attention), the incoming state reaches only the positions whose
document began before the chunk, and the outgoing state holds only the chunk's last document (plus the decayed
incoming state when no reset happened in the chunk). Padding needs nothing: the caller makes it an identity step with
``g = 0, beta = 0``, and sequence lengths that are not a multiple of the chunk are padded here the same way.

Memory is linear in the sequence length: the chunk body runs under ``jax.checkpoint`` inside the scan, so the
backward pass keeps only the state at each chunk boundary (``seq / C`` states) and recomputes the chunk's
``[C, C]`` matrices and its inverse when it reaches it. All arithmetic is float32.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def _decay(mask: Array, log_decay: Array) -> Array:
    """``exp(log_decay)`` where ``mask`` holds and exactly 0 elsewhere.

    The mask is applied before ``exp`` so that a masked entry (the positive exponent of a pair above the diagonal, or
    a log decay across a reset) can neither overflow to ``inf`` (``inf * 0 = nan``) nor leak a gradient.
    """
    return jnp.exp(jnp.where(mask, log_decay, -jnp.inf))


def _einsum(spec: str, a: Array, b: Array) -> Array:
    # Full float32 products: on GPUs the default rounds float32 matmul inputs to TF32 (10 mantissa bits), errors of
    # about 1e-3 where this module promises float32's.
    return jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST)


def _unit_lower_inverse(system: Float[Array, "*batch n n"]) -> Float[Array, "*batch n n"]:
    """``(I + tril(system, -1))^-1`` by recursive doubling of inverted diagonal blocks (the diagonal and the upper
    triangle of ``system`` are not read).

    The inverse of a unit lower triangular ``2s`` block ``[[L11, 0], [L21, L22]]`` is ``[[X11, 0], [-X22 L21 X11,
    X22]]`` with ``X11, X22`` the inverses of its diagonal ``s`` blocks, so ``log2(n)`` levels, each a batch of small
    matmuls over all blocks of the level, build it from the ones on the diagonal. This is the block merge of FLA's
    ``solve_tril``. It replaces a triangular solve, which XLA:CPU runs as a loop of small steps (a whole chunked
    call with one was over ten times slower), and unlike a product of matrix powers (a Neumann series) it forms no
    large terms that cancel, so float32 keeps about the accuracy of a substitution. Only the diagonal blocks are kept
    and multiplied (``[n / 2s, s, s]`` per level), a fraction of the cost of masked whole-matrix products.
    """
    size = system.shape[-1]
    lead = system.shape[:-2]
    n = 1 << (size - 1).bit_length()  # identity rows make the size a power of two
    system = jnp.pad(system, [(0, 0)] * len(lead) + [(0, n - size)] * 2)
    inverse = jnp.ones((*lead, n, 1, 1), system.dtype)  # the inverses of the 1 x 1 diagonal blocks
    block = 1
    while block < n:  # log2(n) levels, unrolled at trace time
        pairs = n // (2 * block)
        halves = inverse.reshape(*lead, pairs, 2, block, block)
        upper, lower = halves[..., 0, :, :], halves[..., 1, :, :]
        # The block below each pair of diagonal blocks: a product with the identity picks the pairs' own blocks
        # out of [pairs, pairs] without a gather.
        crossed = system.reshape(*lead, pairs, 2, block, pairs, 2, block)[..., :, 1, :, :, 0, :]
        below = _einsum("...aibj,ab->...aij", crossed, jnp.eye(pairs, dtype=system.dtype))
        corner = -_einsum("...ij,...jk->...ik", lower, _einsum("...ij,...jk->...ik", below, upper))
        inverse = jnp.concatenate(
            [jnp.concatenate([upper, jnp.zeros_like(upper)], -1), jnp.concatenate([corner, lower], -1)], -2
        )
        block *= 2
    return inverse.reshape(*lead, n, n)[..., :size, :size]


def _chunk(
    state: Float[Array, "batch heads k_dim v_dim"],
    q: Float[Array, "batch heads chunk k_dim"],
    k: Float[Array, "batch heads chunk k_dim"],
    v: Float[Array, "batch heads chunk v_dim"],
    g: Float[Array, "batch heads chunk"],
    beta: Float[Array, "batch heads chunk"],
    doc: Int[Array, "batch chunk"],
    doc_before: Int[Array, " batch"],
) -> tuple[Float[Array, "batch heads k_dim v_dim"], Float[Array, "batch heads chunk v_dim"]]:
    """One chunk: its outputs and the state after it, from the state before it (see the module docstring).

    ``doc_before`` is the document of the token before the chunk (the incoming state's document).
    """
    size, v_dim = q.shape[2], v.shape[3]
    # Log decay from the chunk's start to each position; differences of it are the decays between positions.
    # Sums never cross more than one chunk, so float32 keeps the small per-token decays.
    log = jnp.cumsum(g, axis=-1)
    causal = jnp.tril(jnp.ones((size, size), bool))
    same = (doc[:, :, None] == doc[:, None, :]) & causal  # [batch, i, j]: j <= i, one document
    pair = _decay(same[:, None], log[..., :, None] - log[..., None, :])  # D(j->i)
    from_start = _decay((doc == doc_before[:, None])[:, None], log)  # D(0->i)
    to_end = _decay((doc == doc[:, -1:])[:, None], log[..., -1:] - log)  # D(i->end)
    through = _decay((doc[:, -1] == doc_before)[:, None], log[..., -1])  # D(0->end)

    # The UT system: its strict lower triangle is beta_i D(j->i) k_i . k_j. One inverse serves both right-hand sides.
    system = _einsum("bhik,bhjk->bhij", k, k) * pair * beta[..., :, None]
    rhs = jnp.concatenate([v, k * from_start[..., None]], axis=-1) * beta[..., None]
    solved = _einsum("bhij,bhjd->bhid", _unit_lower_inverse(system), rhs)
    u, w = solved[..., :v_dim], solved[..., v_dim:]
    delta = u - _einsum("bhck,bhkv->bhcv", w, state)

    attention = _einsum("bhik,bhjk->bhij", q, k) * pair
    out = _einsum("bhck,bhkv->bhcv", q * from_start[..., None], state) + _einsum("bhij,bhjv->bhiv", attention, delta)
    state = state * through[..., None, None] + _einsum("bhck,bhcv->bhkv", k * to_end[..., None], delta)
    return state, out


def chunked_delta_rule(
    q: Float[Array, "batch seq heads k_dim"],
    k: Float[Array, "batch seq heads k_dim"],
    v: Float[Array, "batch seq heads v_dim"],
    g: Float[Array, "batch seq heads"],
    beta: Float[Array, "batch seq heads"],
    *,
    resets: Bool[Array, "batch seq"] | None = None,
    initial_state: Float[Array, "batch heads k_dim v_dim"] | None = None,
    chunk_size: int = 64,
) -> tuple[Float[Array, "batch seq heads v_dim"], Float[Array, "batch heads k_dim v_dim"]]:
    """The gated delta rule over a whole sequence, chunk by chunk (see the module docstring).

    ``g`` is the log decay (``<= 0``), ``beta`` the write strength; ``resets[b, t]`` true drops the state before token
    ``t`` (``None``: one document per row); ``initial_state`` the state before the first token (``None``: zeros).
    Returns the outputs in ``v``'s dtype and the float32 state after the last token.
    """
    batch, seq, heads, k_dim = q.shape
    v_dim = v.shape[3]
    state = jnp.zeros((batch, heads, k_dim, v_dim), jnp.float32) if initial_state is None else initial_state
    state = state.astype(jnp.float32)
    if seq == 0:
        return jnp.zeros((batch, 0, heads, v_dim), v.dtype), state
    size = min(chunk_size, seq)  # a short call (decoding) is one chunk of its own length, not a padded one
    chunks = -(-seq // size)
    pad = chunks * size - seq
    resets = jnp.zeros((batch, seq), bool) if resets is None else resets
    doc = jnp.cumsum(resets.astype(jnp.int32), axis=1)  # each position's document: +1 at each reset
    # The document before each chunk: that of its first token, less one if that token starts a new one.
    doc_before = (doc - resets.astype(jnp.int32))[:, ::size]

    def chunked(x: Array) -> Array:
        """``[batch, seq, heads, ...]`` as float32 padded with identity steps, ``[chunks, batch, heads, size, ...]``."""
        x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(batch, chunks, size, *x.shape[2:])
        return jnp.moveaxis(x, (1, 2), (0, 3))

    # Padded positions belong to the last document, so the state passes through them unchanged.
    doc = jnp.pad(doc, [(0, 0), (0, pad)], mode="edge").reshape(batch, chunks, size).transpose(1, 0, 2)
    xs = (chunked(q), chunked(k), chunked(v), chunked(g), chunked(beta), doc, doc_before.T)

    def step(state, x):
        return _chunk(state, *x)

    state, out = jax.lax.scan(jax.checkpoint(step), state, xs)
    out = jnp.moveaxis(out, (0, 3), (1, 2)).reshape(batch, chunks * size, heads, v_dim)[:, :seq]
    return out.astype(v.dtype), state


def recurrent_delta_rule(
    q: Float[Array, "batch seq heads k_dim"],
    k: Float[Array, "batch seq heads k_dim"],
    v: Float[Array, "batch seq heads v_dim"],
    g: Float[Array, "batch seq heads"],
    beta: Float[Array, "batch seq heads"],
    *,
    resets: Bool[Array, "batch seq"] | None = None,
    initial_state: Float[Array, "batch heads k_dim v_dim"] | None = None,
) -> tuple[Float[Array, "batch seq heads v_dim"], Float[Array, "batch heads k_dim v_dim"]]:
    """The same as :func:`chunked_delta_rule`, one token at a time: for decoding, where ``seq`` is usually 1.

    Its backward pass saves a state per token, so long training sequences belong to the chunked form.
    """
    batch, seq, heads, k_dim = q.shape
    v_dim = v.shape[3]
    state = jnp.zeros((batch, heads, k_dim, v_dim), jnp.float32) if initial_state is None else initial_state
    resets = jnp.zeros((batch, seq), bool) if resets is None else resets

    def step(state, x):
        q, k, v, g, beta, reset = x
        state = jnp.where(reset[:, None, None, None], 0.0, state) * jnp.exp(g)[..., None, None]
        delta = beta[..., None] * (v - _einsum("bhkv,bhk->bhv", state, k))
        state = state + k[..., :, None] * delta[..., None, :]
        return state, _einsum("bhkv,bhk->bhv", state, q)

    xs = tuple(jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (q, k, v, g, beta)) + (resets.T,)
    state, out = jax.lax.scan(step, state.astype(jnp.float32), xs)
    return jnp.moveaxis(out, 0, 1).astype(v.dtype), state
