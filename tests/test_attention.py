"""Blockwise attention against the dense reference, which tile it visits, and how a backend is chosen.

The dense reference is the backend the Hugging Face parity tests check (logits to 1e-4, gradients); here
every other backend must give its outputs and gradients to 1e-5 in float32.
"""

import dataclasses
import logging

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe.config import AttentionConfig, LayerKind, ModelConfig, NormConfig
from eqmoe.nn._init import Init
from eqmoe.nn.attention_backends import backend_name, cudnn_attention, dense_attention
from eqmoe.nn.context import Context, attention_mask, causal_mask
from eqmoe.nn.flash import _blocks, blockwise_attention, tile_size
from eqmoe.nn.gqa import GroupedQueryAttention
from tests.tolerances import FLOAT32

BATCH, SEQ, EMBED, BLOCK = 2, 37, 16, 8  # 37 tokens: not a multiple of the block


def _masks():
    """Every kind of row a batch holds: one document, packed documents, left and right padding."""
    packed = jnp.asarray([[0] * 9 + [1] * 20 + [2] * 8, [0] * 16 + [1] * 16 + [2] * 5], jnp.int32)
    left = jnp.arange(SEQ)[None] >= jnp.asarray([[5], [0]])
    right = jnp.arange(SEQ)[None] < jnp.asarray([[SEQ], [30]])
    zeros, ones = jnp.zeros((BATCH, SEQ), jnp.int32), jnp.ones((BATCH, SEQ), bool)
    return {
        "causal": causal_mask(BATCH, SEQ),
        "packed": attention_mask(packed, ones),
        "left_padding": attention_mask(zeros, left),
        "right_padding": attention_mask(zeros, right),
        "packed_and_padded": attention_mask(packed, right),
    }


def _attention(qk_norm: str, kv_heads: int, head_dim: int, backend: str, window: int | None = None):
    config = AttentionConfig(
        num_heads=4, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=100.0, qk_norm=qk_norm, backend=backend
    )
    config = dataclasses.replace(config, block_size=BLOCK)
    model = ModelConfig(
        vocab_size=8, embed_dim=EMBED, attention=config, layers=("dense",), mlp_dim=8, norm=NormConfig(eps=1e-6)
    )
    init = Init("normal", 0.3, jnp.dtype("float32"))
    attention = GroupedQueryAttention(model, LayerKind(ffn="dense", window=window), init=init, key=jax.random.key(0))
    if attention.q_norm is None:
        return attention
    k1, k2 = jax.random.split(jax.random.key(1))
    scales = (1 + 0.5 * jax.random.normal(k1, (head_dim,)), 1 + 0.5 * jax.random.normal(k2, (head_dim,)))
    return eqx.tree_at(lambda a: (a.q_norm.weight, a.k_norm.weight), attention, scales)


def _context(mask, seq: int = SEQ, batch: int = BATCH) -> Context:
    positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    return Context(positions, mask.key_valid, mask.query_segment, mask)


def _loss_and_grads(attention, x, mask, cotangent):
    context = _context(mask)

    @eqx.filter_jit
    @eqx.filter_value_and_grad(has_aux=True)
    def run(parts):
        attention, x = parts
        out, _ = attention(x, context)
        return jnp.sum(out * cotangent), out

    (_, out), grads = run((attention, x))
    return out, grads


# The kernels see q and k after the norm: each placement and each head shape once (all six with -m slow).
@pytest.mark.parametrize(
    ("qk_norm", "kv_heads", "head_dim"),
    [("before_rope", 1, 12), ("after_rope", 2, 6), ("none", 1, 12)]
    + [
        pytest.param(*case, marks=pytest.mark.slow)
        for case in [("before_rope", 2, 6), ("after_rope", 1, 12), ("none", 2, 6)]
    ],
)
def test_blockwise_equals_the_dense_reference_in_outputs_and_gradients(qk_norm, kv_heads, head_dim):
    """Outputs, and gradients of the input, q/k/v/o projections and QK-norm scales, for every mask kind;
    head_dim 12 and 6 are not multiples of the block of 8, nor is the length 37."""
    # Same keys, same weights: only the backend differs.
    dense = _attention(qk_norm, kv_heads, head_dim, "dense")
    blockwise = _attention(qk_norm, kv_heads, head_dim, "blockwise")
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(dense), jax.tree.leaves(blockwise), strict=True))
    x = jax.random.normal(jax.random.key(2), (BATCH, SEQ, EMBED))
    cotangent = jax.random.normal(jax.random.key(3), (BATCH, SEQ, EMBED))
    for name, mask in _masks().items():
        expected, expected_grads = _loss_and_grads(dense, x, mask, cotangent)
        got, got_grads = _loss_and_grads(blockwise, x, mask, cotangent)
        np.testing.assert_allclose(got, expected, atol=FLOAT32, err_msg=name)
        for path, want, have in zip(
            jax.tree_util.tree_flatten_with_path(expected_grads)[0],
            jax.tree.leaves(expected_grads),
            jax.tree.leaves(got_grads),
            strict=True,
        ):
            scale = max(1.0, float(np.abs(want).max()))  # relative to the gradient's size
            np.testing.assert_allclose(
                have, want, atol=FLOAT32 * scale, err_msg=f"{name} {jax.tree_util.keystr(path[0])}"
            )


def test_a_query_that_sees_no_key_gets_zero_in_every_backend():
    """Left padding: the padding queries see only padding keys."""
    mask = _masks()["left_padding"]
    for backend in ("dense", "blockwise"):
        attention = _attention("before_rope", 2, 8, backend)
        x = jax.random.normal(jax.random.key(2), (BATCH, SEQ, EMBED))
        out, _ = _loss_and_grads(attention, x, mask, jnp.ones_like(x))
        np.testing.assert_array_equal(out[0, :5], 0.0)
        assert np.all(np.abs(out[0, 5:]).sum(-1) > 0)


def test_bfloat16_blockwise_stays_close_to_float32():
    attention = _attention("before_rope", 2, 8, "blockwise")
    x = jax.random.normal(jax.random.key(2), (BATCH, SEQ, EMBED))
    mask = _masks()["packed"]
    full, _ = _loss_and_grads(attention, x, mask, jnp.ones_like(x))
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, attention)
    out = eqx.filter_jit(lambda a, x: a(x, _context(mask))[0])(half, x.astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), full, atol=0.05)


def _live_tiles(mask, block: int, window: int | None = None) -> int:
    padded = -(-SEQ // block) * block
    return int(_blocks(mask, padded, padded, block, block, window).live.sum())


def test_hidden_tiles_are_skipped():
    """Causal attention visits the n(n+1)/2 tiles on and below the diagonal; documents that each fit in a
    block visit only their diagonal tiles; a key block that is all padding is never visited."""
    n = -(-SEQ // BLOCK)
    assert _live_tiles(causal_mask(BATCH, SEQ), BLOCK) == n * (n + 1) // 2
    documents = jnp.broadcast_to(jnp.arange(SEQ) // BLOCK, (BATCH, SEQ)).astype(jnp.int32)
    assert _live_tiles(attention_mask(documents, jnp.ones((BATCH, SEQ), bool)), BLOCK) == n
    tail = jnp.broadcast_to(jnp.arange(SEQ) < 2 * BLOCK, (BATCH, SEQ))
    assert _live_tiles(attention_mask(jnp.zeros((BATCH, SEQ), jnp.int32), tail), BLOCK) == n + n - 1  # key blocks 0, 1


def test_auto_picks_cudnn_on_gpu_only_where_the_mask_allows_and_logs_the_choice(caplog):
    config = AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8)
    plain = causal_mask(1, 16)
    packed = attention_mask(jnp.zeros((1, 16), jnp.int32), jnp.ones((1, 16), bool))
    assert backend_name(config, plain, jnp.bfloat16, platform="gpu") == "cudnn"
    assert backend_name(config, plain, jnp.float32, platform="gpu") == "blockwise"  # cuDNN needs half precision
    assert backend_name(config, packed, jnp.bfloat16, platform="gpu") == "blockwise"
    assert backend_name(config, plain, jnp.bfloat16, platform="cpu") == "blockwise"
    assert backend_name(dataclasses.replace(config, backend="dense"), plain, jnp.bfloat16, platform="gpu") == "dense"
    with pytest.raises(ValueError, match="plain causal"):
        cudnn_attention(
            jnp.zeros((1, 2, 2, 16, 8)),
            jnp.zeros((1, 2, 16, 8)),
            jnp.zeros((1, 2, 16, 8)),
            packed,
            scale=1.0,
            block_size=8,
        )
    assert backend_name(config, plain, jnp.bfloat16, platform="gpu", window=4) == "blockwise"  # cuDNN: no window
    assert backend_name(config, plain, jnp.bfloat16, platform="gpu", same_widths=False) == "blockwise"
    assert backend_name(config, plain, jnp.bfloat16, platform="gpu", sinks=True) == "blockwise"  # cuDNN: no sinks
    with pytest.raises(ValueError, match="no attention sinks"):
        q, kv = jnp.zeros((1, 2, 2, 16, 8), jnp.bfloat16), jnp.zeros((1, 2, 16, 8), jnp.bfloat16)
        cudnn_attention(q, kv, kv, plain, scale=1.0, block_size=8, sinks=jnp.zeros((2, 2)))
    attention = _attention("none", 2, 8, "auto")
    with caplog.at_level(logging.INFO, logger="eqmoe.nn.attention_backends"):
        from eqmoe.nn import attention_backends

        attention_backends._logged.clear()
        attention(jnp.zeros((1, 16, EMBED)), _context(plain, 16, 1))
    assert "attention backend 'auto' runs as 'blockwise'" in caplog.text


# --- sliding windows and a value width of its own --------------------------------------------------------------


def _numpy_attention(q, k, v, visible, scale, sinks=None):
    """``softmax(scale q k^T)`` over the visible keys times ``v``, in float64; a query that sees nothing gets 0.
    ``q [b, n, g, T, d]``, ``k [b, n, S, d]``, ``v [b, n, S, e]``, ``visible [b, T, S]``. ``sinks [n, g]``: one more
    logit in each softmax's denominator (gpt-oss's sinks: ``exp(s_h)`` beside the keys' terms, no value)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = np.einsum("bngtd,bnsd->bngts", q, k) * scale
    visible = np.asarray(visible)[:, None, None]
    scores = np.where(visible, scores, -np.inf)
    top = np.max(np.where(visible, scores, -np.inf), axis=-1, keepdims=True)
    sink = None if sinks is None else np.asarray(sinks, np.float64)[None, :, :, None, None]
    if sink is not None:
        top = np.maximum(top, sink)
    weights = np.where(visible, np.exp(scores - np.where(np.isfinite(top), top, 0)), 0)
    total = weights.sum(-1, keepdims=True) + (0 if sink is None else np.exp(sink - top))
    return np.einsum("bngts,bnse->bngte", weights / np.where(total > 0, total, 1), v)


def _numpy_visible(mask, window: int | None) -> np.ndarray:
    """The published rule, written out: query ``q`` sees key ``k`` when ``k <= q`` (and ``q - window < k``),
    both in one document, and the key is a real token."""
    q_index, k_index = np.asarray(mask.query_index), np.asarray(mask.key_index)
    seen = k_index[None, :] <= q_index[:, None]
    if window is not None:
        seen &= k_index[None, :] > q_index[:, None] - window
    same = np.asarray(mask.query_segment)[:, :, None] == np.asarray(mask.key_segment)[:, None, :]
    return seen[None] & same & np.asarray(mask.key_valid)[:, None, :]


@pytest.mark.parametrize(
    ("window", "with_sinks"),
    [(3, False), (8, True), (13, True), (100, False), (None, True)],
    ids=["3<tile", "8=tile+sinks", "13>tile+sinks", "100>length", "full+sinks"],
)
def test_sliding_windows_and_sinks_in_both_backends_equal_the_published_rule(window, with_sinks):
    """Outputs against a NumPy softmax over ``q - W < k <= q`` (the sliding-window mask transformers builds) with
    the sink's term in the denominator, and the blockwise kernel's outputs and gradients (the sinks' included)
    against the dense reference, for packed and padded rows and a length (37) that is not a multiple of the tile
    (8)."""
    kq, kk, kv, kc, ks = jax.random.split(jax.random.key(7), 5)
    q = jax.random.normal(kq, (BATCH, 2, 2, SEQ, 6))
    k = jax.random.normal(kk, (BATCH, 2, SEQ, 6))
    v = jax.random.normal(kv, (BATCH, 2, SEQ, 10))  # a value width of its own
    cotangent = jax.random.normal(kc, (BATCH, 2, 2, SEQ, 10))
    sinks = 2.0 * jax.random.normal(ks, (2, 2)) if with_sinks else None  # large enough to take a real share
    for name, mask in _masks().items():
        want = _numpy_attention(q, k, v, _numpy_visible(mask, window), 0.4, sinks)
        outputs, grads = {}, {}
        for backend in (dense_attention, blockwise_attention):

            def loss(q, k, v, sinks, backend=backend, mask=mask):
                out = backend(q, k, v, mask, scale=0.4, block_size=BLOCK, window=window, sinks=sinks)
                return jnp.sum(out * cotangent), out

            argnums = (0, 1, 2, 3) if with_sinks else (0, 1, 2)
            (_, out), grad = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(q, k, v, sinks)
            outputs[backend.__name__], grads[backend.__name__] = out, grad
            np.testing.assert_allclose(out, want, atol=FLOAT32, err_msg=f"{name} {backend.__name__}")
        for want_grad, got_grad in zip(grads["dense_attention"], grads["blockwise_attention"], strict=True):
            np.testing.assert_allclose(got_grad, want_grad, atol=FLOAT32 * max(1.0, float(np.abs(want_grad).max())))


def test_a_sliding_layer_visits_only_the_tiles_its_window_reaches():
    """With a window no wider than a tile each query block sees its own and at most one earlier key block:
    ``2n - 1`` tiles instead of the causal ``n(n+1)/2``."""
    n = -(-SEQ // BLOCK)
    assert _live_tiles(causal_mask(BATCH, SEQ), BLOCK, window=BLOCK) == 2 * n - 1
    assert _live_tiles(causal_mask(BATCH, SEQ), BLOCK, window=1) == n
    # a sliding layer's tiles shrink to its window (at least 64): gpt-oss's 128 in tiles of 128, not 256
    assert [tile_size(256, w) for w in (None, 128, 100, 8, 1000)] == [256, 128, 104, 64, 256]
    assert tile_size(BLOCK, 3) == BLOCK


def test_a_sliding_gqa_layer_equals_the_full_one_within_its_window():
    """The same weights, full and sliding: equal while no query is further than the window from its document's
    start, different after."""
    full = _attention("before_rope", 2, 8, "blockwise")
    sliding = _attention("before_rope", 2, 8, "blockwise", window=5)
    x = jax.random.normal(jax.random.key(2), (BATCH, SEQ, EMBED))
    context = _context(causal_mask(BATCH, SEQ))
    out_full, _ = full(x, context)
    out_sliding, _ = sliding(x, context)
    np.testing.assert_allclose(out_sliding[:, :5], out_full[:, :5], atol=1e-6)
    assert float(jnp.max(jnp.abs(out_sliding[:, 5:] - out_full[:, 5:]))) > 1e-3
