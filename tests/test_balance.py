"""Aux-loss-free bias balancing and sigmoid routing, against NumPy re-derivations of DeepSeek-V3's rule."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe import Transformer, presets
from eqmoe.config import MoEConfig, RouterConfig
from eqmoe.models.qwen3_moe import config_to_hf
from eqmoe.nn._init import Init
from eqmoe.nn.router import Router
from eqmoe.train.balance import update_router_biases
from eqmoe.train.optimizer import OptimizerConfig, make_optimizer
from eqmoe.train.state import init_state
from eqmoe.train.step import Batch, make_train_step


def _router(num_experts=8, top_k=2, rate=0.01, **changes):
    config = RouterConfig(
        num_experts=num_experts, top_k=top_k, strategy="sigmoid_top_k", bias_update_rate=rate, **changes
    )
    return Router(16, config, init=Init("normal", 0.02, jnp.dtype("float32")), key=jax.random.key(0))


def _numpy_sigmoid_routing(logits, bias, top_k, renormalize, scale):
    scores = 1 / (1 + np.exp(-logits))
    experts = np.argsort(-(scores + bias), axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(scores, experts, axis=-1)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * scale, experts


@pytest.mark.parametrize("renormalize", [True, False])
def test_sigmoid_routing_matches_numpy_and_bias_only_selects(renormalize):
    router = _router(renormalize=renormalize, routed_scaling_factor=2.5)
    bias = np.asarray(jax.random.normal(jax.random.key(1), (8,)) * 0.3, np.float32)
    router = eqx.tree_at(lambda r: r.bias, router, jnp.asarray(bias))
    x = jax.random.normal(jax.random.key(2), (64, 16))
    routing = router(x, jnp.ones(64, bool))
    logits = np.asarray(x @ router.gate.weight, np.float64)
    weights, experts = _numpy_sigmoid_routing(logits, bias, 2, renormalize, 2.5)
    np.testing.assert_array_equal(np.asarray(routing.experts), experts)
    np.testing.assert_allclose(np.asarray(routing.weights), weights, rtol=1e-5)
    grad = jax.grad(lambda r: r(x, jnp.ones(64, bool)).weights.sum())(router)
    np.testing.assert_array_equal(np.asarray(grad.bias), 0.0)  # the bias never receives a gradient


def test_bias_updates_move_a_skewed_routing_toward_uniform():
    router = _router(rate=0.002)
    # Skew the gate: a shared direction in the tokens makes experts 0 and 1 win almost every time.
    weight = np.asarray(router.gate.weight).copy()
    weight[:, 0] += 0.5
    weight[:, 1] += 0.3
    router = eqx.tree_at(lambda r: r.gate.weight, router, jnp.asarray(weight))
    x = jax.random.normal(jax.random.key(3), (512, 16)) + 1.0
    mask = jnp.ones(512, bool)

    def load_cv(router):
        counts = np.bincount(np.asarray(router(x, mask).experts).ravel(), minlength=8)
        return counts.std() / counts.mean(), counts

    start_cv, counts = load_cv(router)
    bias = np.zeros(8)
    for _ in range(300):
        _, counts = load_cv(router)
        bias = bias + 0.002 * np.sign(counts.mean() - counts)  # DeepSeek-V3's rule, re-derived
        counts_jax = jnp.asarray(counts, jnp.float32)[None]
        model_like = router.bias + 0.002 * jnp.sign(counts_jax.mean(-1, keepdims=True) - counts_jax)[0]
        router = eqx.tree_at(lambda r: r.bias, router, model_like)
    np.testing.assert_allclose(np.asarray(router.bias), bias, atol=1e-5)
    end_cv, _ = load_cv(router)
    assert start_cv > 1.0 and end_cv < 0.25, (start_cv, end_cv)


def _mixed_config(rate):
    base = presets.get("qwen3-moe-micro")
    moe = MoEConfig(
        router=RouterConfig(num_experts=8, top_k=2, strategy="sigmoid_top_k", bias_update_rate=rate),
        expert_dim=base.moe.expert_dim,
    )
    layers = ("dense", "moe") * 2 + ("moe",) * 3
    return base.replace(layers=layers, moe=moe, mlp_dim=64)


def test_bias_update_reaches_the_router_of_each_layer_in_order():
    config = _mixed_config(rate=0.5)
    model = Transformer(config, key=jax.random.key(0))
    # Layer l (of 5 MoE layers) overloads expert l: its bias must fall there and rise elsewhere.
    counts = jnp.asarray(np.eye(5, 8) * 10 + 1, jnp.float32)
    updated = update_router_biases(model, counts)
    biases = [
        *np.asarray(updated.segments[0].blocks[1].ffn.router.bias),  # layers 1, 3 -> MoE rows 0, 1
        *np.asarray(updated.segments[1].blocks[0].ffn.router.bias),  # layers 4, 5, 6 -> MoE rows 2, 3, 4
    ]
    for row, bias in enumerate(biases):
        expected = np.full(8, 0.5)
        expected[row] = -0.5
        np.testing.assert_array_equal(bias, expected)
    with pytest.raises(ValueError, match="5 MoE layers"):
        update_router_biases(model, counts[:4])


def test_train_step_moves_the_bias_only_by_the_balancing_rule():
    config = _mixed_config(rate=0.01)
    model = Transformer(config, key=jax.random.key(0))
    optimizer, schedule = make_optimizer(
        OptimizerConfig(learning_rate=1e-2, warmup_steps=0, weight_decay=0.5),
        eqx.filter(model, eqx.is_array),
        embed_dim=64,
    )
    state = init_state(model, optimizer, key=jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (4, 32), 0, config.vocab_size)
    batch = Batch(tokens, jnp.ones_like(tokens), jnp.broadcast_to(jnp.arange(32), (4, 32)), jnp.ones((4, 32), bool))
    output = model(tokens)
    expected = update_router_biases(model, output.aux.expert_counts)
    router_weight = np.asarray(model.segments[1].blocks[0].ffn.router.gate.weight)
    new_state, _ = make_train_step(optimizer, schedule)(batch, state)
    np.testing.assert_allclose(
        np.asarray(new_state.model.segments[1].blocks[0].ffn.router.bias),
        np.asarray(expected.segments[1].blocks[0].ffn.router.bias),
        atol=1e-7,
    )
    np.testing.assert_allclose(
        np.asarray(new_state.model.segments[0].blocks[1].ffn.router.bias),
        np.asarray(expected.segments[0].blocks[1].ffn.router.bias),
        atol=1e-7,
    )
    assert not np.allclose(np.asarray(new_state.model.segments[1].blocks[0].ffn.router.gate.weight), router_weight)


def test_biased_or_scaled_router_has_no_hugging_face_export():
    base = presets.get("qwen3-moe-micro")
    for field, value in (("bias_update_rate", 0.01), ("routed_scaling_factor", 2.5)):
        router = RouterConfig(**{**base.moe.router.__dict__, field: value})
        config = base.replace(moe=MoEConfig(router=router, expert_dim=base.moe.expert_dim))
        with pytest.raises(ValueError, match=f"moe.router.{field}"):
            config_to_hf(config)


def test_router_config_rejects_bad_balancing_fields():
    with pytest.raises(ValueError, match="bias_update_rate"):
        RouterConfig(num_experts=8, top_k=2, bias_update_rate=-1.0)
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        RouterConfig(num_experts=8, top_k=2, routed_scaling_factor=0.0)
