"""The decoder fields the other families brought, each against a NumPy re-derivation of its published equation:
DeepSeek-V3 group-limited routing, shared experts (gated and not) on every dispatch backend, partial RoPE,
attention biases with a QK-norm over the whole projection and clip_qkv; and their configs as overrides.
Family parity against transformers is in tests/test_olmoe.py, test_qwen2_moe.py and test_glm4_moe.py."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe import presets
from eqmoe.config import AttentionConfig, MoEConfig, RouterConfig
from eqmoe.config_io import apply_overrides
from eqmoe.nn import dispatch
from eqmoe.nn._init import Init
from eqmoe.nn.moe import MoE
from eqmoe.nn.rope import apply_rope, rope_tables
from eqmoe.nn.router import STRATEGIES
from tests.parts import gqa

INIT = Init("normal", 0.2, np.dtype("float32"))


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _group_limited_reference(scores, bias, top_k, groups, kept, renormalize):
    """Token by token, as DeepSeek-V3 describes it: choice c = s + b; a group's score is the sum of its two
    largest c; the top-k of c among the experts of the ``kept`` best groups; weights are their s."""
    tokens, experts = scores.shape
    size = experts // groups
    weights, chosen = np.zeros((tokens, top_k)), np.zeros((tokens, top_k), int)
    for t in range(tokens):
        choice = scores[t] + bias
        group_score = [sorted(choice[g * size : (g + 1) * size])[-2:] for g in range(groups)]
        best_groups = sorted(range(groups), key=lambda g: -sum(group_score[g]))[:kept]
        eligible = [e for e in range(experts) if e // size in best_groups]
        best = sorted(eligible, key=lambda e: -choice[e])[:top_k]
        chosen[t], weights[t] = best, scores[t, best]
        if renormalize:
            weights[t] /= weights[t].sum() + 1e-20
    return weights, chosen


@pytest.mark.parametrize(
    ("strategy", "transform", "renormalize"),
    [("sigmoid_top_k", _sigmoid, True), ("sigmoid_top_k", _sigmoid, False), ("softmax_top_k", _softmax, True)],
)
def test_group_limited_routing_equals_the_published_rule(strategy, transform, renormalize):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 16)).astype(np.float32)
    bias = rng.normal(scale=0.3, size=16).astype(np.float32)
    config = RouterConfig(
        num_experts=16, top_k=3, strategy=strategy, renormalize=renormalize, expert_groups=4, expert_groups_kept=2
    )
    weights, experts = STRATEGIES.get(strategy).route(jnp.asarray(logits), config, jnp.asarray(bias))
    want_weights, want_experts = _group_limited_reference(transform(logits), bias, 3, 4, 2, renormalize)
    np.testing.assert_array_equal(np.sort(np.asarray(experts), -1), np.sort(want_experts, -1))
    order = np.argsort(np.asarray(experts), -1), np.argsort(want_experts, -1)
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(weights), order[0], -1), np.take_along_axis(want_weights, order[1], -1), 1e-6
    )
    # the limit matters here: without it some tokens choose experts outside their two best groups
    plain = dataclasses.replace(config, expert_groups=1, expert_groups_kept=None)
    _, unlimited = STRATEGIES.get(strategy).route(jnp.asarray(logits), plain, jnp.asarray(bias))
    assert (np.sort(np.asarray(unlimited), -1) != np.sort(want_experts, -1)).any(axis=-1).mean() > 0.2


def _swiglu(x, gate, up, down):
    g = x @ gate
    return (g * _sigmoid(g) * (x @ up)) @ down


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("backend", ["dense", "sorted", "ragged_dot", "capacity"])
def test_shared_experts_add_a_dense_swiglu_on_every_backend(backend, gated):
    """y = routed(x) + [sigmoid(x g)] * swiglu_{width shared * dim}(x); routed is each backend's own output
    without shared experts, so the shared part is checked against NumPy on all of them."""
    capacity = 8.0 if backend == "capacity" else None  # no token dropped: the same routing as dropless
    router = RouterConfig(num_experts=4, top_k=2, capacity_factor=capacity)
    config = MoEConfig(router, expert_dim=16, shared_experts=2, shared_expert_dim=12, shared_expert_gate=gated)
    config = dataclasses.replace(config, dispatch=backend)
    moe = MoE(24, config, init=INIT, key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (2, 10, 24))
    y, _ = moe(x)
    flat = x.reshape(-1, 24)
    routed = dispatch.resolve(config)(flat, moe.router(flat, jnp.ones(20, bool)), moe.experts, config)
    shared = moe.shared_expert
    assert shared.gate.weight.shape == (24, 24)  # two shared experts of width 12 are one SwiGLU of width 24
    flat = np.asarray(flat)
    want = _swiglu(flat, *(np.asarray(w) for w in (shared.gate.weight, shared.up.weight, shared.down.weight)))
    if gated:
        want = _sigmoid(flat @ np.asarray(moe.shared_gate.weight)) * want
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 24) - np.asarray(routed), want, atol=2e-5)


def test_experts_on_every_backend_agree_with_shared_experts():
    x = jax.random.normal(jax.random.key(3), (2, 12, 24))
    outputs = {}
    for backend in ("dense", "sorted", "ragged_dot"):
        router = RouterConfig(num_experts=8, top_k=2, expert_groups=4, expert_groups_kept=2)
        config = MoEConfig(router, expert_dim=16, shared_experts=1, shared_expert_gate=True, dispatch=backend)
        outputs[backend] = np.asarray(MoE(24, config, init=INIT, key=jax.random.key(4))(x)[0])
    for backend, y in outputs.items():
        np.testing.assert_allclose(y, outputs["dense"], atol=1e-5, err_msg=backend)
    assert dispatch.BACKENDS.get("dense") is not None


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def test_partial_rope_rotates_the_first_dimensions_as_a_narrower_head():
    """GLM-4.5: the first ``rotary_dim`` of each head rotate with frequencies theta^(-2i/rotary_dim), half-split
    within them; the rest pass through."""
    head_dim, rotary, theta = 16, 8, 1e4
    positions = jnp.arange(40)[None]
    cos, sin = rope_tables(positions, rotary, theta, jnp.float32)
    x = np.random.default_rng(1).normal(size=(1, 40, 3, head_dim)).astype(np.float32)
    out = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
    inv_freq = 1.0 / theta ** (np.arange(0, rotary, 2) / rotary)
    angles = np.arange(40)[:, None] * inv_freq[None]
    table_cos = np.concatenate([np.cos(angles)] * 2, -1)[None, :, None]
    table_sin = np.concatenate([np.sin(angles)] * 2, -1)[None, :, None]
    np.testing.assert_allclose(out[..., :rotary], _rotate(x[..., :rotary], table_cos, table_sin), atol=1e-5)
    np.testing.assert_array_equal(out[..., rotary:], x[..., rotary:])


def _rms(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * weight


def test_biases_whole_projection_norm_and_clip_follow_olmoe_order():
    """OLMoE: q = clip(norm_{heads*head_dim}(x Wq + bq)), k likewise over kv_heads*head_dim, v = clip(x Wv + bv),
    then RoPE; output x Wo + bo."""
    config = AttentionConfig(
        num_heads=4, num_kv_heads=2, head_dim=8, bias="qkvo", qk_norm_scope="projection", clip_qkv=0.6
    )
    attention = gqa(32, config, eps=1e-5, init=Init("normal", 0.3, np.dtype("float32")), key=jax.random.key(5))
    rng = np.random.default_rng(2)
    names = ("q", "k", "v", "o")
    attention = eqx.tree_at(
        lambda a: [getattr(a, n).bias for n in names] + [a.q_norm.weight],
        attention,
        [jnp.asarray(rng.normal(size=getattr(attention, n).bias.shape), jnp.float32) for n in names]
        + [jnp.asarray(1 + 0.2 * rng.normal(size=32), jnp.float32)],
    )
    assert attention.q_norm.weight.shape == (32,) and attention.k_norm.weight.shape == (16,)
    x = rng.normal(size=(1, 6, 32)).astype(np.float32)
    cos, sin = rope_tables(jnp.arange(6)[None], 8, config.rope_theta, jnp.float32)
    q, k, v, _ = attention._project(jnp.asarray(x), jnp.arange(6)[None], None)
    flat = x.reshape(6, 32)
    w = {name: np.asarray(getattr(attention, name).weight).reshape(32, -1) for name in ("q", "k", "v")}
    b = {name: np.asarray(getattr(attention, name).bias).reshape(-1) for name in ("q", "k", "v")}
    want_q = np.clip(_rms(flat @ w["q"] + b["q"], np.asarray(attention.q_norm.weight), 1e-5), -0.6, 0.6)
    want_k = np.clip(_rms(flat @ w["k"] + b["k"], np.asarray(attention.k_norm.weight), 1e-5), -0.6, 0.6)
    want_v = np.clip(flat @ w["v"] + b["v"], -0.6, 0.6)
    c, s = np.asarray(cos)[0][:, None], np.asarray(sin)[0][:, None]
    want_q, want_k = _rotate(want_q.reshape(6, 4, 8), c, s), _rotate(want_k.reshape(6, 2, 8), c, s)
    # ours are head-major: q [batch, kv_heads, group, seq, head_dim], k and v [batch, kv_heads, seq, head_dim]
    np.testing.assert_allclose(np.asarray(q)[0].transpose(2, 0, 1, 3).reshape(6, 4, 8), want_q, atol=1e-5)
    np.testing.assert_allclose(np.asarray(k)[0].transpose(1, 0, 2), want_k, atol=1e-5)
    np.testing.assert_allclose(np.asarray(v)[0].transpose(1, 0, 2).reshape(6, 16), want_v, atol=1e-5)
    assert np.abs(flat @ w["v"] + b["v"]).max() > 0.6  # the clamp acted


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"attention.rotary_dim": 7}, "AttentionConfig.rotary_dim=7"),
        ({"attention.rotary_dim": 32}, "AttentionConfig.rotary_dim=32"),
        ({"attention.qk_norm_scope": "projection", "attention.qk_norm": "after_rope"}, "qk_norm_scope"),
        ({"attention.bias": "qk"}, "attention.bias"),
        ({"attention.clip_qkv": -1.0}, "AttentionConfig.clip_qkv=-1.0"),
        ({"moe.router.expert_groups": 3}, "RouterConfig.expert_groups=3"),
        ({"moe.router.expert_groups": 2, "moe.router.expert_groups_kept": 3}, "expert_groups_kept=3"),
        ({"moe.router.expert_groups": 8}, "groups of at least 2 experts"),
        ({"moe.router.expert_groups": 4, "moe.router.expert_groups_kept": 1, "moe.router.top_k": 3}, "top_k=3"),
        ({"moe.shared_expert_gate": True}, "shared_expert_gate"),
        ({"moe.shared_experts": -1}, "MoEConfig.shared_experts=-1"),
    ],
)
def test_invalid_family_fields_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")) as excinfo:
        apply_overrides(presets.get("qwen3-moe-micro"), overrides)
    assert "\n" not in str(excinfo.value)


def test_rope_scaling_is_an_override_from_a_json_object():
    base = presets.get("qwen3-moe-micro")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    config = apply_overrides(base, {"attention.rope_scaling": yarn})
    assert config.attention.rope_scaling.rope_type == "yarn" and config.attention.rope_scaling.factor == 4.0
    assert apply_overrides(config, {"attention.rope_scaling.factor": 2}).attention.rope_scaling.factor == 2.0
    assert apply_overrides(config, {"attention.rope_scaling": None}).attention.rope_scaling is None
    with pytest.raises(ValueError, match="override attention.rope_scaling: RopeScaling has no field 'factr'"):
        apply_overrides(base, {"attention.rope_scaling": {"rope_type": "linear", "factr": 2.0}})
    with pytest.raises(ValueError, match="override attention.rope_scaling.rope_type='ntk': not a valid"):
        apply_overrides(base, {"attention.rope_scaling": {"rope_type": "ntk", "factor": 2.0}})
    with pytest.raises(ValueError, match="override attention.rope_scaling=.*RopeScaling.factor=-2.0 is invalid"):
        apply_overrides(base, {"attention.rope_scaling": {"rope_type": "linear", "factor": -2}})
