"""AXLearn Top2Gating with capacity, against a loop-by-loop NumPy reference written from the equations.

Per group of S tokens: p = softmax(logits); e1 = argmax p, e2 = argmax of the rest; g_i = p_ei / (p_e1 + p_e2
+ 1e-9). C = max(1, int(S * factor / E)). Every top-1 assignment is placed before any top-2 one, earlier
tokens first; an assignment past C is dropped (weight 0, kept weights not renormalised).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eqmoe.config import AttentionConfig, LayerKind, ModelConfig, MoEConfig, NormConfig, RouterConfig
from eqmoe.nn._init import Init
from eqmoe.nn.block import Block
from eqmoe.nn.context import attention_mask
from eqmoe.nn.moe import MoE
from eqmoe.nn.router import expert_capacity
from eqmoe.nn.routing_stats import router_stats
from tests.parts import context

# --- NumPy reference -------------------------------------------------------------------------------------


def _softmax(logits):
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def reference_top2(logits, num_groups, capacity_factor):
    """``(weights[T, 2], experts[T, 2], kept[T, 2])`` with explicit loops over tokens."""
    logits = np.asarray(logits, np.float64)
    tokens, num_experts = logits.shape
    size = tokens // num_groups
    capacity = max(1, int(size * capacity_factor / num_experts))
    probs = _softmax(logits)
    weights, experts, kept = np.zeros((tokens, 2)), np.zeros((tokens, 2), np.int64), np.zeros((tokens, 2), bool)
    for t in range(tokens):
        e1 = int(np.argmax(probs[t]))
        rest = probs[t].copy()
        rest[e1] = -np.inf
        e2 = int(np.argmax(rest))
        g1, g2 = probs[t, e1], probs[t, e2]
        experts[t] = e1, e2
        weights[t] = g1 / (g1 + g2 + 1e-9), g2 / (g1 + g2 + 1e-9)
    for g in range(num_groups):
        group = range(g * size, (g + 1) * size)
        earlier_top1 = [0] * num_experts
        for t in group:
            e = experts[t, 0]
            kept[t, 0] = earlier_top1[e] < capacity
            earlier_top1[e] += 1
        kept_top1 = [sum(kept[t, 0] and experts[t, 0] == e for t in group) for e in range(num_experts)]
        earlier_top2 = [0] * num_experts
        for t in group:
            e = experts[t, 1]
            kept[t, 1] = kept_top1[e] + earlier_top2[e] < capacity
            earlier_top2[e] += 1
    return np.where(kept, weights, 0.0), experts, kept


def reference_moe(x, weights, experts, kept, w_gate, w_up, w_down):
    """``y_t = sum over kept assignments of g * (silu(x Wg) * (x Wu)) Wd``, in float64."""
    x, w_gate, w_up, w_down = (np.asarray(a, np.float64) for a in (x, w_gate, w_up, w_down))
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(2):
            if kept[t, j]:
                e = experts[t, j]
                a = x[t] @ w_gate[e]
                y[t] += weights[t, j] * ((a / (1 + np.exp(-a))) * (x[t] @ w_up[e])) @ w_down[e]
    return y


def reference_top1_balance(logits, experts, num_groups):
    """``E^2 * mean over groups and experts of f_e * P_e`` (f: top-1 fraction before drops, P: mean prob)."""
    num_experts = logits.shape[-1]
    probs = _softmax(np.asarray(logits, np.float64)).reshape(num_groups, -1, num_experts)
    top1 = np.eye(num_experts)[experts[:, 0]].reshape(num_groups, -1, num_experts)
    return num_experts**2 * np.mean(top1.mean(axis=1) * probs.mean(axis=1))


# --- eqmoe side ------------------------------------------------------------------------------------------


def _moe(num_experts, embed, factor, groups, backend, router_weight, seed=0):
    router = RouterConfig(num_experts, 2, strategy="top2_gating", capacity_factor=factor, num_groups=groups)
    config = MoEConfig(router, expert_dim=6, dispatch=backend, block_size=4)
    moe = MoE(embed, config, init=Init("normal", 0.5, jnp.dtype("float32")), key=jax.random.key(seed))
    return eqx.tree_at(lambda m: m.router.gate.weight, moe, jnp.asarray(router_weight, jnp.float32))


@eqx.filter_jit
def _forward(moe, x):
    flat = x.reshape(-1, x.shape[-1])
    routing = moe.router(flat, jnp.ones(flat.shape[0], bool))
    y, returned = moe(x)
    return routing, y, router_stats(returned, jnp.ones(x.shape[:2], bool), moe.config.router.num_groups)


def _expert_weights(moe):
    return moe.experts.gate.weight, moe.experts.up.weight, moe.experts.down.weight


CAPACITY_CASES = [(50, 40.0, 40, 50), (50, 2.5, 40, 3), (8192, 2.5, 40, 512)]  # (S, factor, E, C)


@pytest.mark.parametrize(("size", "factor", "experts", "capacity"), CAPACITY_CASES)
def test_expert_capacity(size, factor, experts, capacity):
    assert expert_capacity(size, experts, factor) == capacity


# Hand-built: (top-1, top-2) per token, 8 tokens, 4 experts, C = int(8 * 1.0 / 4) = 2.
# Tokens 0-3 put expert 0 second, tokens 4-7 put it first: the later top-1s must win the two slots.
HAND = [(1, 0), (2, 0), (3, 0), (1, 0), (0, 2), (0, 3), (0, 2), (0, 3)]
HAND_KEPT = [(1, 0), (1, 0), (1, 0), (1, 0), (1, 1), (1, 1), (0, 0), (0, 0)]


def _hand_case(backend="capacity"):
    logits = np.zeros((8, 4), np.float32)
    for t, (e1, e2) in enumerate(HAND):
        logits[t, e1], logits[t, e2] = 2.0 + 0.1 * t, 1.0
    moe = _moe(4, 4, 1.0, 1, backend, np.eye(4))  # identity router: logits = x
    return logits, moe, _forward(moe, jnp.asarray(logits)[None])


def test_drop_order_top1_before_top2_and_earlier_first():
    logits, _, (routing, _, stats) = _hand_case()
    np.testing.assert_array_equal(routing.experts, np.array(HAND))
    np.testing.assert_array_equal(routing.kept, np.array(HAND_KEPT, bool))
    _, _, ref_kept = reference_top2(logits, 1, 1.0)
    np.testing.assert_array_equal(ref_kept, np.array(HAND_KEPT, bool))  # the reference agrees with the hand
    assert float(stats.dropped) == 8.0
    np.testing.assert_allclose(stats.dropped_fraction, 8 / 16)


@pytest.mark.parametrize("backend", ["capacity", "sorted", "dense"])
def test_dropped_top2_keeps_unrenormalised_top1_weight(backend):
    logits, moe, (routing, y, _) = _hand_case(backend)
    p = _softmax(logits.astype(np.float64))
    for t in range(4):  # top-2 dropped, top-1 kept
        e1, e2 = HAND[t]
        g1 = p[t, e1] / (p[t, e1] + p[t, e2] + 1e-9)
        assert g1 < 0.99
        np.testing.assert_allclose(routing.weights[t], [g1, 0.0], rtol=1e-6)
    ref = reference_moe(logits, *reference_top2(logits, 1, 1.0), *_expert_weights(moe))
    np.testing.assert_allclose(y[0], ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(y[0, 6:], 0.0)  # both assignments dropped: exactly zero


def test_hybridnorm_fully_dropped_token_is_identity_through_ffn():
    seq, experts = 16, 4  # C = max(1, int(16 * 0.25 / 4)) = 1: at most 8 tokens keep anything
    router = RouterConfig(experts, 2, strategy="top2_gating", capacity_factor=0.25)
    config = ModelConfig(
        vocab_size=16,
        embed_dim=16,
        attention=AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=8),
        layers=("moe",),
        moe=MoEConfig(router, expert_dim=8, dispatch="capacity"),
        norm=NormConfig(ffn_placement="hybrid"),
        init_std=0.5,
    )
    block = eqx.filter_jit(lambda key: Block(LayerKind(ffn="moe"), config, key=key))(jax.random.key(0))  # one compile
    block = eqx.tree_at(lambda b: b.post_norm.weight, block, jnp.linspace(0.5, 1.5, 16))
    x = jax.random.normal(jax.random.key(1), (1, seq, 16))
    token_mask = jnp.ones((1, seq), bool)
    ctx = context(attention_mask(jnp.zeros((1, seq), jnp.int32), token_mask))

    @eqx.filter_jit
    def run(block, x):  # the residual is formed from the block's own parts in the same program
        residual = x + block.attention(block.attn_norm(x), ctx)[0]
        out, routing, _ = block(x, ctx)
        return (out, router_stats(routing, token_mask, 1)), residual, block.pre_norm(residual)[0]

    (out, stats), residual, h = run(block, x)
    weights, chosen, kept = reference_top2(h @ block.ffn.router.gate.weight, 1, 0.25)
    dropped_tokens = ~kept.any(axis=1)
    assert dropped_tokens.sum() >= 8
    np.testing.assert_array_equal(np.asarray(out)[0, dropped_tokens], np.asarray(residual)[0, dropped_tokens])
    y = reference_moe(h, weights, chosen, kept, *_expert_weights(block.ffn))
    expected = residual + block.post_norm(jnp.asarray(y, jnp.float32))[None]
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)
    assert float(stats.dropped) == float((~kept).sum())


TOKENS, EXPERTS, EMBED = 16, 4, 8  # fixed shapes: one program per (factor, groups, backend)


@pytest.mark.parametrize("backend", ["capacity", "sorted", "dense"])
@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    factor=st.sampled_from([0.5, 1.0, 2.0]),
    groups=st.sampled_from([1, 2]),
    scale=st.sampled_from([0.5, 3.0]),
    skew=st.sampled_from([0.0, 2.0]),
)
def test_random_routing_matches_reference(backend, seed, factor, groups, scale, skew):
    """Logits are the first E input columns (router weight [I; 0]); ``skew`` favours expert 0 to force drops."""
    key_logits, key_rest = jax.random.split(jax.random.key(seed))
    logits = scale * jax.random.normal(key_logits, (TOKENS, EXPERTS)) + skew * (jnp.arange(EXPERTS) == 0)
    x = jnp.concatenate([logits, jax.random.normal(key_rest, (TOKENS, EMBED - EXPERTS))], axis=1)
    router_weight = np.eye(EMBED, EXPERTS)
    ref_w, ref_e, ref_k = reference_top2(np.asarray(logits), groups, factor)
    moe = _moe(EXPERTS, EMBED, factor, groups, backend, router_weight, seed=1)
    routing, y, stats = _forward(moe, x.reshape(2, TOKENS // 2, EMBED))
    np.testing.assert_allclose(routing.logits, logits, atol=1e-6)
    np.testing.assert_array_equal(routing.experts, ref_e)
    np.testing.assert_array_equal(routing.kept, ref_k)
    np.testing.assert_allclose(routing.weights, ref_w, atol=1e-5, rtol=1e-5)
    y_ref = reference_moe(x, ref_w, ref_e, ref_k, *_expert_weights(moe))
    np.testing.assert_allclose(y.reshape(TOKENS, EMBED), y_ref, atol=1e-5, rtol=1e-5)
    assert float(stats.dropped) == float((~ref_k).sum())
    np.testing.assert_allclose(stats.dropped_fraction, (~ref_k).mean(), rtol=1e-6)
    np.testing.assert_allclose(stats.top1_balance, reference_top1_balance(logits, ref_e, groups), rtol=1e-5)
