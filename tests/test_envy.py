"""Envy: both readings' presets, RoPE/QK-norm layouts, the top-1 router gradient, losses, overfitting."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Float

from eqmoe import Transformer, presets
from eqmoe.analysis import count_parameters
from eqmoe.config import AttentionConfig, RouterConfig
from eqmoe.losses import next_token_cross_entropy, objective
from eqmoe.nn import Layer, Role, param
from eqmoe.nn._init import Init
from eqmoe.nn.context import attention_mask
from eqmoe.nn.gqa import GroupedQueryAttention as Attention
from eqmoe.train.optimizer import OptimizerConfig, envy_optimizer, make_optimizer, model_params
from tests.parts import context, gqa


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [
        ("envy-switch-base", 22_077_958_656, 674_425_344),
        ("envy-switch-base-maxtext", 22_077_958_656, 504_556_032),
        ("envy-switch-large", 78_386_454_528, None),
        ("envy-switch-large-maxtext", 78_386_454_528, None),
        ("envy-switch-xxl", 396_486_064_128, None),
        ("envy-switch-xxl-maxtext", 396_486_064_128, None),
    ],
)
def test_parameter_counts_match_the_published_totals(name, total, active):
    counted_total, counted_active = count_parameters(presets.get(name))
    assert counted_total == total
    if active is not None:
        assert counted_active == active


def test_the_two_readings_differ_only_in_the_named_fields():
    axlearn, maxtext = presets.get("envy-switch-base"), presets.get("envy-switch-base-maxtext")
    differing = {f.name for f in dataclasses.fields(axlearn) if getattr(axlearn, f.name) != getattr(maxtext, f.name)}
    assert differing == {"attention", "moe", "loss", "tied_logit_scale"}
    assert (axlearn.attention.qk_norm, maxtext.attention.qk_norm) == ("after_rope", "before_rope")
    assert (axlearn.attention.rope_layout, maxtext.attention.rope_layout) == ("interleaved", "half_split")
    assert dataclasses.replace(axlearn.moe, router=maxtext.moe.router) == maxtext.moe


# --- RoPE layouts and QK-norm placement -------------------------------------------------------------

HEAD_DIM = 8
# Half-split pairs dimension i with i + D/2; interleaved pairs 2i with 2i+1.
TO_INTERLEAVED = np.stack([np.arange(HEAD_DIM // 2), np.arange(HEAD_DIM // 2) + HEAD_DIM // 2], axis=1).reshape(-1)


def _with_config(attention: Attention, config: AttentionConfig) -> Attention:
    """The same weights under another config (QK-norm present in both)."""
    fresh = gqa(16, config, init=Init("normal", 0.3, jnp.dtype("float32")), key=jax.random.key(0))
    return jax.tree.unflatten(jax.tree.structure(fresh), jax.tree.leaves(attention))


def _attention(qk_norm: str, layout: str, key) -> Attention:
    config = AttentionConfig(
        num_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, rope_theta=100.0, rope_layout=layout, qk_norm=qk_norm
    )
    attention = gqa(16, config, init=Init("normal", 0.3, jnp.dtype("float32")), key=key)
    if qk_norm == "none":
        return attention
    k1, k2 = jax.random.split(jax.random.fold_in(key, 1))
    scales = (1.0 + 0.5 * jax.random.normal(k1, (HEAD_DIM,)), 1.0 + 0.5 * jax.random.normal(k2, (HEAD_DIM,)))
    return eqx.tree_at(lambda a: (a.q_norm.weight, a.k_norm.weight), attention, scales)


def _run(attention: Attention, x):
    mask = attention_mask(jnp.zeros(x.shape[:2], jnp.int32), jnp.ones(x.shape[:2], bool))
    return attention(x, context(mask))[0]


def _to_interleaved(attention: Attention, qk_norm: str) -> Attention:
    """The same attention in the interleaved layout: q/k weights and QK-norm scales permuted on head_dim."""
    config = dataclasses.replace(attention.config, rope_layout="interleaved", qk_norm=qk_norm)
    permuted = eqx.tree_at(
        lambda a: (a.q.weight, a.k.weight),
        attention,
        (attention.q.weight[..., TO_INTERLEAVED], attention.k.weight[..., TO_INTERLEAVED]),
    )
    if attention.q_norm is not None:
        permuted = eqx.tree_at(
            lambda a: (a.q_norm.weight, a.k_norm.weight),
            permuted,
            (attention.q_norm.weight[TO_INTERLEAVED], attention.k_norm.weight[TO_INTERLEAVED]),
        )
    return _with_config(permuted, config)


@pytest.mark.parametrize("qk_norm", ["none", "before_rope", "after_rope"])
def test_interleaved_rope_on_permuted_weights_equals_half_split(qk_norm):
    half_split = _attention(qk_norm, "half_split", jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 7, 16))
    np.testing.assert_allclose(_run(_to_interleaved(half_split, qk_norm), x), _run(half_split, x), atol=1e-5)


def test_qk_norm_before_and_after_rope_differ_with_non_uniform_scales():
    before = _attention("before_rope", "half_split", jax.random.key(2))
    after = _with_config(before, dataclasses.replace(before.config, qk_norm="after_rope"))
    x = jax.random.normal(jax.random.key(3), (1, 6, 16))
    assert float(jnp.max(jnp.abs(_run(before, x) - _run(after, x)))) > 1e-3
    uniform = eqx.tree_at(lambda a: (a.q_norm.weight, a.k_norm.weight), before, (jnp.full(HEAD_DIM, 1.3),) * 2)
    uniform_after = _with_config(uniform, after.config)
    np.testing.assert_allclose(_run(uniform, x), _run(uniform_after, x), atol=1e-5)


# --- routing gradient: MaxText top-1 vs Switch top-1 --------------------------------------------------


def _router_gradient(config):
    model = Transformer(config, key=jax.random.key(4))
    tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, config.vocab_size)

    def cross_entropy(model):
        return next_token_cross_entropy(model(tokens).logits, tokens, jnp.ones(tokens.shape, bool))

    grads = eqx.filter_jit(eqx.filter_grad(cross_entropy))(model)
    return grads.segments[0].blocks[1].ffn.router.gate.weight


def test_maxtext_top1_router_gets_no_gradient_from_the_lm_loss_but_switch_does():
    maxtext = presets.get("envy-test-maxtext")
    assert float(jnp.max(jnp.abs(_router_gradient(maxtext)))) == 0.0
    switch = dataclasses.replace(
        maxtext, moe=dataclasses.replace(maxtext.moe, router=RouterConfig(8, 1, "softmax_top_k", renormalize=False))
    )
    assert float(jnp.max(jnp.abs(_router_gradient(switch)))) > 1e-6


# --- which losses are trained ---------------------------------------------------------------------------


def _numpy_sequence_balance(experts: np.ndarray, probs: np.ndarray, num_experts: int) -> float:
    """MaxText: density[b, e] = mean_s sum_k 1[idx = e]; P[b, e] = mean_s p; E^2 * mean(density * P)."""
    density = np.stack([(experts == e).sum(-1).mean(-1) for e in range(num_experts)], axis=-1)
    return float(num_experts**2 * np.mean(density * probs.mean(1)))


@pytest.mark.parametrize("name", ["envy-test", "envy-test-maxtext"])
def test_objective_trains_the_configured_terms(name):
    config = presets.get(name)
    model = Transformer(config, key=jax.random.key(6))
    tokens = jax.random.randint(jax.random.key(7), (4, 16), 0, config.vocab_size)
    output = model(tokens)
    loss, terms = objective(output, tokens, jnp.ones(tokens.shape, bool), config)
    if name == "envy-test":
        np.testing.assert_allclose(loss, terms["cross_entropy"] + 1e-6 * terms["output_z_loss"], rtol=1e-6)
        logits = np.asarray(output.logits[:, :-1], np.float64)
        lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        np.testing.assert_allclose(terms["output_z_loss"], np.mean(lse**2), rtol=1e-5)
    else:
        np.testing.assert_allclose(
            loss, terms["cross_entropy"] + 0.01 * terms["load_balance_maxtext_sequence"], rtol=1e-6
        )
        moe = jax.tree.map(lambda leaf: leaf[0], model.segments[0].blocks[1])
        # Recompute layer 1's routing from its input to check the per-sequence form independently.
        h = _layer_input(model, tokens)
        routing = moe.ffn.router(moe.pre_norm(h).reshape(-1, config.embed_dim), jnp.ones(64, bool))
        expected = _numpy_sequence_balance(
            np.asarray(routing.experts).reshape(4, 16, 1), np.asarray(routing.probs).reshape(4, 16, -1), 8
        )
        np.testing.assert_allclose(output.aux.sequence_balance[0], expected, rtol=1e-5)
    assert {"load_balance_hf_pooled", "load_balance_axlearn_top1", "router_z_loss", "dropped_fraction"} <= set(terms)


def _layer_input(model: Transformer, tokens):
    """The input of the first MoE block (after the first dense block and the MoE block's attention)."""
    ctx = context(attention_mask(jnp.zeros(tokens.shape, jnp.int32), jnp.ones(tokens.shape, bool)))
    blocks = jax.tree.map(lambda leaf: leaf[0], model.segments[0].blocks)
    x, _, _ = blocks[0](model.embed[tokens], ctx)
    return x + blocks[1].attention(blocks[1].attn_norm(x), ctx)[0]


# --- optimizer preset -----------------------------------------------------------------------------------


def test_envy_optimizer_step_matches_the_axlearn_update_rule():
    """One step re-derived in NumPy: p -= lr_t * mup * adam(clip(g)) + wd * (lr_t / lr) * p."""
    config = dataclasses.replace(envy_optimizer(1536), warmup_steps=2, decay_steps=10)
    params = _ThreeRoles(wq=jnp.full((3,), 2.0), router=jnp.full((3,), -1.0), norm=jnp.ones(3))
    grads = jax.tree.map(lambda p: jnp.arange(1.0, 4.0) * 10.0, params)
    tx, schedule = make_optimizer(config, params, embed_dim=1536)
    state = tx.init(params)
    for _ in range(2):  # the first step has lr 0 (warmup from 0)
        updates, state = tx.update(grads, state, params)
    g = np.arange(1.0, 4.0) * 10.0
    g = g * min(1.0, 1.0 / np.linalg.norm(np.concatenate([g, g, g])))
    m, v = (1 - 0.9**2) * g, (1 - 0.95**2) * g**2
    adam = (m / (1 - 0.9**2)) / (np.sqrt(v / (1 - 0.95**2)) + 1e-8)
    lr = float(schedule(1))
    assert lr == pytest.approx(0.005)
    expected = {
        "wq": -lr * 0.5 * adam - 1e-4 * (lr / 0.01) * 2.0,
        "router": -lr * adam - 1e-4 * (lr / 0.01) * -1.0,
        "norm": -lr * adam,
    }
    np.testing.assert_allclose(updates.wq, expected["wq"], rtol=1e-5)
    np.testing.assert_allclose(updates.router, expected["router"], rtol=1e-5)
    np.testing.assert_allclose(updates.norm, expected["norm"], rtol=1e-5)


class _ThreeRoles(Layer):
    """One parameter of each role the AXLearn rule treats differently: mup-scaled, decayed, neither."""

    wq: Float[Array, " n"] = param(Role.ATTENTION)
    router: Float[Array, " n"] = param(Role.ROUTER)
    norm: Float[Array, " n"] = param(Role.NORM)


def test_an_optimizer_refuses_arrays_without_a_role():
    with pytest.raises(ValueError, match=r"\['wq'\] is an array outside any eqmoe.nn.Layer"):
        make_optimizer(envy_optimizer(1536), {"wq": jnp.ones(3)}, embed_dim=1536)


# --- learning ------------------------------------------------------------------------------------------


# the MaxText reading's own behaviour (its router gradient, its objective) has tests of its own
@pytest.mark.parametrize("name", ["envy-test", pytest.param("envy-test-maxtext", marks=pytest.mark.slow)])
def test_envy_test_overfits_a_fixed_batch(name):
    config = presets.get(name)
    model = Transformer(config, key=jax.random.key(8))
    starts = jax.random.randint(jax.random.key(9), (8, 1), 0, config.vocab_size)
    tokens = (starts + jnp.arange(64) * (1 + starts % 3)) % config.vocab_size  # a fixed batch of 8 x 64
    mask = jnp.ones(tokens.shape, bool)
    tx, _ = make_optimizer(
        OptimizerConfig(learning_rate=3e-2, warmup_steps=10, weight_decay=0.0),
        model_params(model),
        embed_dim=config.embed_dim,
    )
    state = tx.init(model_params(model))

    @eqx.filter_jit
    def step(model, state):
        (loss, _), grads = eqx.filter_value_and_grad(
            lambda m: objective(m(tokens), tokens, mask, config), has_aux=True
        )(model)
        updates, state = tx.update(grads, state, model_params(model))
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for _ in range(100):
        model, state, loss = step(model, state)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses[::10]
