"""Scanned vs unrolled stacks, and the dropless grouped dispatch vs the dense reference."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eqmoe import presets
from eqmoe.config import MoEConfig, RouterConfig
from eqmoe.losses import objective
from eqmoe.model import Transformer
from eqmoe.nn import dispatch
from eqmoe.nn._init import Init
from eqmoe.nn.moe import MoE
from eqmoe.nn.router import Routing

SMALL = presets.get("qwen3-moe-tiny").replace(
    vocab_size=64,
    embed_dim=32,
    layers=tuple(["dense", "moe", "dense", "moe"]),  # a unit of two layers, scanned twice
    mlp_dim=48,
)


@eqx.filter_jit
def _loss_and_grads(model, tokens):
    def loss_fn(model):
        return objective(model(tokens), tokens, jnp.ones(tokens.shape, bool), model.config)[0]

    return eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model)


# remat=block recomputes what the scan saves: its numbers are checked against an uninterrupted run by
# tests/test_resume_execution.py, and its memory by tests/test_plan.py
@pytest.mark.parametrize("remat", ["none", pytest.param("block", marks=pytest.mark.slow)])
def test_scanned_and_unrolled_stacks_agree(remat):
    tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, SMALL.vocab_size)
    scanned = Transformer(SMALL.replace(remat=remat), key=jax.random.key(0))
    unrolled = Transformer(SMALL.replace(scan_layers=False, remat=remat), key=jax.random.key(0))
    for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(unrolled), strict=True):
        np.testing.assert_array_equal(a, b)
    out_s, out_u = eqx.filter_jit(scanned)(tokens), eqx.filter_jit(unrolled)(tokens)
    np.testing.assert_allclose(out_s.logits, out_u.logits, atol=1e-6, rtol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6), out_s.aux, out_u.aux)
    (loss_s, grads_s), (loss_u, grads_u) = _loss_and_grads(scanned, tokens), _loss_and_grads(unrolled, tokens)
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_s), jax.tree.leaves(grads_u), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def test_a_stack_unrolled_in_its_scan_computes_what_the_scan_computes():
    """scan_unroll at least the stack's repeats runs them all in one scan iteration (what sft and pretrain do for a
    shallow model): the same logits and gradients; a deeper stack is still scanned one repeat at a time."""
    tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, SMALL.vocab_size)
    scanned = Transformer(SMALL, key=jax.random.key(0))
    depth = scanned.segments[0].repeats  # a unit of two layers, twice
    unrolled = Transformer(SMALL.replace(scan_unroll=depth), key=jax.random.key(0))
    deeper = Transformer(SMALL.replace(scan_unroll=depth - 1), key=jax.random.key(0))
    assert [s.unroll for s in scanned.segments] == [1] and [s.unroll for s in unrolled.segments] == [depth]
    assert [s.unroll for s in deeper.segments] == [1]
    logits = [eqx.filter_jit(model)(tokens).logits for model in (scanned, unrolled)]
    np.testing.assert_allclose(*logits, atol=1e-6)
    (loss_s, grads_s), (loss_u, grads_u) = _loss_and_grads(scanned, tokens), _loss_and_grads(unrolled, tokens)
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_s), jax.tree.leaves(grads_u), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="scan_unroll"):
        SMALL.replace(scan_unroll=0)


def test_the_unrolled_gradient_of_a_stacked_parameter_is_one_stack():
    """Unrolled, each stacked parameter's gradient is its layers' gradients stacked once, not each layer's padded
    into a zero-filled stack and the stacks added (on 2 CPU cores that made a 4-layer train step 8-9% slower)."""
    config = SMALL.replace(scan_layers=False, layers=tuple(["moe"] * 3))
    params, static = eqx.partition(Transformer(config, key=jax.random.key(0)), eqx.is_array)
    tokens = jnp.zeros((1, 5), jnp.int32)
    loss = lambda p: jnp.mean(eqx.combine(p, static)(tokens).logits)  # noqa: E731
    stacked = {leaf.shape for leaf in jax.tree.leaves(params) if leaf.ndim >= 2 and leaf.shape[0] == 3}
    assert len(stacked) >= 5  # the router's, the experts', attention's and the norms' weights

    def made(jaxpr) -> list[str]:
        found = []
        for equation in jaxpr.eqns:
            found += [equation.primitive.name for v in equation.outvars if getattr(v.aval, "shape", ()) in stacked]
            for inner in jax.extend.core.jaxprs_in_params(equation.params):
                found += made(inner)
        return found

    primitives = made(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
    assert "pad" not in primitives and "dynamic_update_slice" not in primitives and "scatter-add" not in primitives


def test_router_stats_are_in_layer_order():
    """A unit of two MoE blocks scanned twice reports four layers in checkpoint order."""
    config = SMALL.replace(layers=tuple(["moe", "moe"] * 2))
    model = Transformer(config, key=jax.random.key(2))
    tokens = jax.random.randint(jax.random.key(3), (1, 6), 0, config.vocab_size)
    aux = eqx.filter_jit(model)(tokens).aux
    assert aux.expert_counts.shape == (4, config.moe.router.num_experts)
    unrolled = Transformer(config.replace(scan_layers=False), key=jax.random.key(2))
    np.testing.assert_allclose(aux.prob_sum, eqx.filter_jit(unrolled)(tokens).aux.prob_sum, atol=1e-6)
    assert float(aux.expert_counts.sum()) == 4 * 6 * config.moe.router.top_k


def _moe_case(num_experts, top_k, embed=8, width=6, seed=0):
    config = MoEConfig(RouterConfig(num_experts=num_experts, top_k=top_k), expert_dim=width, dispatch="dense")
    return MoE(embed, config, init=Init("normal", 0.5, jnp.dtype("float32")), key=jax.random.key(seed))


@functools.partial(jax.jit, static_argnames=("backend", "block_size"))
def _dispatch_outputs_and_grads(backend, moe, x, weights, experts, block_size):
    config = dataclasses.replace(moe.config, block_size=block_size)

    def f(x, weights, params):
        routing = Routing(
            weights,
            experts,
            jnp.ones(experts.shape, bool),
            jnp.zeros_like(experts),
            jnp.zeros((x.shape[0], config.router.num_experts)),
        )
        y = dispatch.BACKENDS.get(backend).run(x, routing, params, config)
        return jnp.sum(jnp.sin(y)), y

    (_, y), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(x, weights, moe.experts)
    return y, grads


DROPLESS = ("sorted", "ragged_dot")
# XLA:CPU's emulated ragged_dot transposes with ~2e-6 relative error against a float64 reference (three
# times float32 rounding at these sizes), so its gradients get a looser bound than the 1e-5 of the others.
GRADIENT_TOLERANCE = {"sorted": 1e-5, "ragged_dot": 5e-5}


def _check_agreement(moe, x, weights, experts, block_size):
    """Each dropless backend's output and gradients (input, routing weights, every expert weight) equal dense's."""
    y_ref, g_ref = _dispatch_outputs_and_grads("dense", moe, x, weights, experts, block_size)
    for backend in DROPLESS:
        y, g = _dispatch_outputs_and_grads(backend, moe, x, weights, experts, block_size)
        np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5, err_msg=backend)
        for got, want in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
            # Relative to the gradient's scale: with init std 0.5 gradients reach ~16, and a near-zero entry
            # summed from such terms carries float32 rounding of ~1e-6 of that scale in every backend, dense
            # included (checked against float64).
            tolerance = GRADIENT_TOLERANCE[backend]
            scale = max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(got, want, atol=tolerance * scale, rtol=tolerance, err_msg=backend)


@pytest.mark.parametrize(
    ("name", "num_experts", "top_k", "tokens", "block_size"),
    [
        ("typical", 8, 2, 24, 4),
        ("top_k = num_experts", 4, 4, 10, 3),
        ("one token", 6, 2, 1, 4),
        ("blocks larger than all slots", 5, 2, 7, 64),
    ],
)
def test_dropless_dispatch_matches_dense(name, num_experts, top_k, tokens, block_size):
    moe = _moe_case(num_experts, top_k)
    x = jax.random.normal(jax.random.key(5), (tokens, 8))
    routing = moe.router(x, jnp.ones(tokens, bool))
    _check_agreement(moe, x, routing.weights, routing.experts, block_size)


def test_dropless_dispatch_all_tokens_to_one_expert_and_empty_experts():
    moe = _moe_case(6, 2)
    x = jax.random.normal(jax.random.key(6), (9, 8))
    experts = jnp.tile(jnp.array([[4, 1]]), (9, 1))  # expert 4 takes every token; 0, 2, 3, 5 are empty
    weights = jax.random.uniform(jax.random.key(7), (9, 2))
    _check_agreement(moe, x, weights, experts, block_size=4)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_dropless_dispatch_random_routings(data):
    """Random routings of 16 tokens over 6 experts, top-3, blocks of 4 (one compiled program)."""
    num_experts, top_k, tokens = 6, 3, 16
    experts = jnp.array([data.draw(st.permutations(range(num_experts)))[:top_k] for _ in range(tokens)])
    seed = data.draw(st.integers(0, 2**16))
    moe = _moe_case(num_experts, top_k)
    key_x, key_w = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(key_x, (tokens, 8))
    weights = jax.random.uniform(key_w, (tokens, top_k))
    _check_agreement(moe, x, weights, experts, block_size=4)


def test_dropless_dispatch_with_a_lone_token_on_an_expert():
    """A routing hypothesis found: expert 5 gets one token, so its weight gradient has near-zero entries."""
    experts = jnp.array([[0, 1, 2]] * 4 + [[5, 0, 3]] + [[0, 1, 2]] * 11)
    key_x, key_w = jax.random.split(jax.random.key(44093))
    x, weights = jax.random.normal(key_x, (16, 8)), jax.random.uniform(key_w, (16, 3))
    _check_agreement(_moe_case(6, 3), x, weights, experts, block_size=4)


@settings(max_examples=10, deadline=None)
@given(expert=st.integers(0, 5), skew=st.floats(0.0, 1.0))
def test_dropless_dispatch_skewed_routings(expert, skew):
    """Most tokens on one expert, so its group spans several blocks while others are empty."""
    tokens = 16
    crowded = int(skew * tokens)
    first = jnp.where(jnp.arange(tokens) < crowded, expert, jnp.arange(tokens) % 6)
    second = (first + 1 + jnp.arange(tokens) % 5) % 6
    experts = jnp.stack([first, second], axis=1)
    moe = _moe_case(6, 2)
    x = jax.random.normal(jax.random.key(expert), (tokens, 8))
    _check_agreement(moe, x, jnp.full((tokens, 2), 0.5), experts, block_size=4)


def test_model_with_each_backend_agrees():
    tokens = jax.random.randint(jax.random.key(8), (2, 7), 0, SMALL.vocab_size)
    outputs = {}
    for backend in ("dense", "sorted", "ragged_dot", "auto"):
        config = SMALL.replace(moe=MoEConfig(SMALL.moe.router, SMALL.moe.expert_dim, dispatch=backend, block_size=4))
        outputs[backend] = Transformer(config, key=jax.random.key(0))(tokens).logits
    np.testing.assert_allclose(outputs["sorted"], outputs["dense"], atol=1e-5)
    np.testing.assert_allclose(outputs["ragged_dot"], outputs["dense"], atol=1e-5)
    np.testing.assert_allclose(outputs["auto"], outputs["dense"], atol=1e-5)


def test_dropless_memory_is_linear_in_tokens():
    """No intermediate of the sorted backend's forward+backward grows like tokens x experts: every array in
    the program is at most the padded rows times the widest dimension (the fused gate|up rows, twice the
    expert width), or one weight stack."""
    embed, width, num_experts, top_k, block = 24, 40, 16, 2, 8
    config = MoEConfig(
        RouterConfig(num_experts=num_experts, top_k=top_k), expert_dim=width, dispatch="sorted", block_size=block
    )
    moe = MoE(embed, config, init=Init("normal", 0.5, jnp.dtype("float32")), key=jax.random.key(0))

    def temp_bytes_and_largest(tokens):
        x = jnp.zeros((1, tokens, embed))
        grad = eqx.filter_grad(lambda m, x: jnp.sum(m(x)[0] ** 2))
        jaxpr = jax.make_jaxpr(grad)(moe, x)
        sizes = [v.aval.size for eqn in _all_eqns(jaxpr.jaxpr) for v in eqn.outvars if hasattr(v.aval, "size")]
        params, static = eqx.partition(moe, eqx.is_array)
        compiled = jax.jit(lambda p, x: grad(eqx.combine(p, static), x)).lower(params, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes, max(sizes)

    small, largest_small = temp_bytes_and_largest(512)
    large, largest_large = temp_bytes_and_largest(2048)
    rows = 2048 * top_k + num_experts * block
    assert largest_large <= max(rows * max(embed, 2 * width), num_experts * embed * width, 2048 * num_experts)
    assert large <= 4.5 * small, (small, large)  # 4x the tokens: at most ~4x the temporaries


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else ():
            yield from _all_eqns(sub)
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", None)
            if inner is not None:
                yield from _all_eqns(getattr(inner, "jaxpr", inner))
