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

from eqmoe.config import AttentionConfig
from eqmoe.nn._init import Init
from eqmoe.nn.attention import Attention, attention_mask, backend_name, causal_mask, cudnn_attention
from eqmoe.nn.flash import _blocks
from eqmoe.nn.rope import rope_tables

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


def _attention(qk_norm: str, kv_heads: int, head_dim: int, backend: str) -> Attention:
    config = AttentionConfig(
        num_heads=4, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=100.0, qk_norm=qk_norm, backend=backend
    )
    config = dataclasses.replace(config, block_size=BLOCK)
    attention = Attention(
        EMBED,
        config,
        eps=1e-6,
        stats_dtype="float32",
        init=Init("normal", 0.3, jnp.dtype("float32")),
        key=jax.random.key(0),
    )
    if attention.q_norm is None:
        return attention
    k1, k2 = jax.random.split(jax.random.key(1))
    scales = (1 + 0.5 * jax.random.normal(k1, (head_dim,)), 1 + 0.5 * jax.random.normal(k2, (head_dim,)))
    return eqx.tree_at(lambda a: (a.q_norm.weight, a.k_norm.weight), attention, scales)


def _loss_and_grads(attention: Attention, x, mask, cotangent):
    positions = jnp.broadcast_to(jnp.arange(SEQ), (BATCH, SEQ))
    cos, sin = rope_tables(positions, attention.config.head_dim, 100.0, jnp.float32)

    @eqx.filter_jit
    @eqx.filter_value_and_grad(has_aux=True)
    def run(parts):
        attention, x = parts
        out = attention(x, cos, sin, mask)
        return jnp.sum(out * cotangent), out

    (_, out), grads = run((attention, x))
    return out, grads


@pytest.mark.parametrize("qk_norm", ["before_rope", "after_rope", "none"])
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(1, 12), (2, 6)])
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
        np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=name)
        for path, want, have in zip(
            jax.tree_util.tree_flatten_with_path(expected_grads)[0],
            jax.tree.leaves(expected_grads),
            jax.tree.leaves(got_grads),
            strict=True,
        ):
            scale = max(1.0, float(np.abs(want).max()))  # 1e-5 relative to the gradient's size
            np.testing.assert_allclose(have, want, atol=1e-5 * scale, err_msg=f"{name} {jax.tree_util.keystr(path[0])}")


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
    positions = jnp.broadcast_to(jnp.arange(SEQ), (BATCH, SEQ))
    cos, sin = rope_tables(positions, 8, 100.0, jnp.bfloat16)
    out = eqx.filter_jit(lambda a, x: a(x, cos, sin, mask))(half, x.astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), full, atol=0.05)


def _live_tiles(mask, block: int) -> int:
    padded = -(-SEQ // block) * block
    return int(_blocks(mask, padded, padded, block, block).live.sum())


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
    attention = _attention("none", 2, 8, "auto")
    positions = jnp.arange(16)[None]
    cos, sin = rope_tables(positions, 8, 100.0, jnp.float32)
    with caplog.at_level(logging.INFO, logger="eqmoe.nn.attention"):
        from eqmoe.nn import attention as attention_module

        attention_module._logged.clear()
        attention(jnp.zeros((1, 16, EMBED)), cos, sin, plain)
    assert "attention backend 'auto' runs as 'blockwise'" in caplog.text
