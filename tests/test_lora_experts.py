"""LoRA on the routed experts, computed inside every dispatch backend without merging the weights.

For each registered backend, an MoE whose experts carry random (nonzero) adapters must equal the same
backend on merged weights ``W + scale * A @ B`` in outputs, in the input gradient and in the base weights'
gradients, and its adapter gradients must equal the merged weight's gradient carried onto the factors:
``dL/dA_e = scale * dL/dW_e @ B_e^T`` and ``dL/dB_e = scale * A_e^T @ dL/dW_e``. Expert parallelism on 8
simulated devices must agree with one device's ``sorted`` backend (:func:`mesh_case`, run by
``tests/mesh_cases.py`` in the process of 8 devices ``tests/test_parallel.py`` starts).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe import parallel
from eqmoe.config import MoEConfig, RouterConfig
from eqmoe.nn import dispatch
from eqmoe.nn._init import Init
from eqmoe.nn.linear import LowRank
from eqmoe.nn.moe import MoE

EMBED, WIDTH, RANK, SCALE = 8, 6, 3, 0.75
MATRICES = ("gate", "up", "down")
# Adapted subsets: all three, and partial ones so a missing pair of each side (gate|up, down) is covered.
SUBSETS = [("gate", "up", "down"), ("up",), ("gate", "down")]


def _moe(backend: str, num_experts: int = 6, top_k: int = 2, seed: int = 0) -> MoE:
    capacity_factor = 1.5 if backend == "capacity" else None  # some assignments are dropped
    router = RouterConfig(num_experts=num_experts, top_k=top_k, capacity_factor=capacity_factor)
    config = MoEConfig(router, expert_dim=WIDTH, dispatch=backend, block_size=4)
    return MoE(EMBED, config, init=Init("normal", 0.5, jnp.dtype("float32")), key=jax.random.key(seed))


def _adapters(num_experts: int, matrices=MATRICES, seed: int = 1) -> dict[str, LowRank | None]:
    """Random adapters on ``matrices``: both factors nonzero, so every term of the adapter is exercised."""
    shapes = {
        "gate": ((num_experts, EMBED, RANK), (num_experts, RANK, WIDTH), "embed", "expert_mlp"),
        "up": ((num_experts, EMBED, RANK), (num_experts, RANK, WIDTH), "embed", "expert_mlp"),
        "down": ((num_experts, WIDTH, RANK), (num_experts, RANK, EMBED), "expert_mlp", "embed"),
    }
    keys = iter(jax.random.split(jax.random.key(seed), 6))
    adapters = {}
    for name, (a_shape, b_shape, fan_in, fan_out) in shapes.items():
        a, b = 0.5 * jax.random.normal(next(keys), a_shape), 0.5 * jax.random.normal(next(keys), b_shape)
        adapter = LowRank(a, b, SCALE, 0.0, ("experts",), (fan_in,), (fan_out,))
        adapters[name] = adapter if name in matrices else None
    return adapters


def _with_lora(moe: MoE, adapters: dict[str, LowRank | None] | None) -> MoE:
    adapters = adapters or dict.fromkeys(MATRICES)
    where = lambda m: [getattr(m.experts, name).adapter for name in MATRICES]  # noqa: E731
    return eqx.tree_at(where, moe, [adapters[name] for name in MATRICES], is_leaf=lambda x: x is None)


def _merged(moe: MoE) -> MoE:
    """``moe`` with every adapter folded into its weight, ``W_e + scale * A_e @ B_e`` written out here, and no
    adapters left."""
    weights = []
    for name in MATRICES:
        linear = getattr(moe.experts, name)
        delta = 0 if linear.adapter is None else SCALE * jnp.einsum("eir,ero->eio", linear.adapter.a, linear.adapter.b)
        weights.append(linear.weight + delta)
    merged = eqx.tree_at(
        lambda m: (m.experts.gate.weight, m.experts.up.weight, m.experts.down.weight), moe, tuple(weights)
    )
    return _with_lora(merged, None)


@eqx.filter_jit
def _output_and_grads(moe: MoE, x):
    """The layer output and the gradients of ``sum(sin(y))`` w.r.t. the layer (all arrays) and ``x``."""

    def loss(moe_and_x):
        y = moe_and_x[0](moe_and_x[1])[0]
        return jnp.sum(jnp.sin(y)), y

    (_, y), grads = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))((moe, x))
    return y, grads


def _close(got, want, tolerance: float, what: str):
    """Equal up to ``tolerance`` of ``want``'s largest entry: a near-zero entry summed from large terms
    carries float32 rounding of that scale (see tests/test_stack_and_dispatch.py)."""
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, atol=tolerance * scale, rtol=tolerance, err_msg=what)


def _projected(d_weight, a, b, scale):
    """The merged weight's gradient carried onto the factors: ``(s dW B^T, s A^T dW)`` per expert."""
    d_a = scale * jnp.einsum("eio,ero->eir", d_weight, b)
    d_b = scale * jnp.einsum("eir,eio->ero", a, d_weight)
    return d_a, d_b


def _check_against_merged(adapted: MoE, x, tolerance: float):
    y, (d_moe, d_x) = _output_and_grads(adapted, x)
    y_merged, (d_merged, d_x_merged) = _output_and_grads(_merged(adapted), x)
    y_base = _output_and_grads(_with_lora(adapted, None), x)[0]
    assert float(jnp.abs(y_merged - y_base).max()) > 0.1, "the adapters must change the output"
    _close(y, y_merged, 1e-5, "output")
    _close(d_x, d_x_merged, tolerance, "d x")
    for name in MATRICES:
        adapter, d_adapter = getattr(adapted.experts, name).adapter, getattr(d_moe.experts, name).adapter
        d_weight = getattr(d_merged.experts, name).weight
        # The base weight enters as W + s A B too, so its gradient is the merged weight's.
        _close(getattr(d_moe.experts, name).weight, d_weight, tolerance, f"d {name}")
        if adapter is None:
            assert d_adapter is None
            continue
        want_a, want_b = _projected(d_weight, adapter.a, adapter.b, adapter.scale)
        _close(d_adapter.a, want_a, tolerance, f"d {name}_a")
        _close(d_adapter.b, want_b, tolerance, f"d {name}_b")
    _close(d_moe.router.gate.weight, d_merged.router.gate.weight, tolerance, "d router")


# XLA:CPU's emulated ragged_dot transposes with a few 1e-6 of relative error (tests/test_stack_and_dispatch.py).
GRADIENT_TOLERANCE = {"ragged_dot": 5e-5}


def _cases():
    """Every backend with all three matrices adapted; the partial subsets on sorted (whose kernel fuses the
    gate and up adapters); the other backends' subsets under -m slow (one einsum per matrix, covered above)."""
    for backend in dispatch.BACKENDS.names():
        for matrices in SUBSETS:
            slow = len(matrices) < 3 and backend != "sorted"
            marks = [pytest.mark.slow] if slow else []
            yield pytest.param(backend, matrices, id=f"{backend}-{'+'.join(matrices)}", marks=marks)


@pytest.mark.parametrize(("backend", "matrices"), list(_cases()))
def test_adapters_equal_merged_weights(backend, matrices):
    moe = _moe(backend)
    x = jax.random.normal(jax.random.key(5), (2, 12, EMBED))
    adapted = _with_lora(moe, _adapters(6, matrices))
    _check_against_merged(adapted, x, GRADIENT_TOLERANCE.get(backend, 1e-5))


@pytest.mark.parametrize("backend", ["sorted", "ragged_dot"])
def test_adapters_with_crowded_and_empty_experts(backend):
    """All tokens on two of eight experts: groups span several (wide) tiles, six experts get no rows."""
    moe = _moe(backend, num_experts=8, top_k=2)
    bias = jnp.zeros((EMBED, 8)).at[:, 3].set(50.0).at[:, 6].set(49.0)
    moe = eqx.tree_at(lambda m: m.router.gate.weight, moe, moe.router.gate.weight + bias)
    x = jnp.abs(jax.random.normal(jax.random.key(6), (1, 40, EMBED)))  # positive rows: biased logits win
    experts = moe.router(x.reshape(-1, EMBED), jnp.ones(40, bool)).experts
    assert set(np.unique(np.asarray(experts))) == {3, 6}
    _check_against_merged(_with_lora(moe, _adapters(8)), x, GRADIENT_TOLERANCE.get(backend, 1e-5))


def test_unadapted_experts_hold_no_adapter_leaves():
    moe = _moe("sorted")
    assert all(getattr(moe.experts, name).adapter is None for name in MATRICES)
    assert len(jax.tree.leaves(moe.experts)) == 3


# --- expert parallelism on 8 simulated devices -------------------------------------------------------------

MESHES = ["expert=8", "data=2,expert=4", "fsdp=2,expert=4", "data=2,tensor=2,expert=2"]


def mesh_case(mesh: str):
    """The adapted ``sorted`` MoE on one device and with expert parallelism on ``mesh``: the same output and
    gradients (adapters, base weights, router, input)."""
    moe = _with_lora(_moe("sorted", num_experts=8, top_k=2, seed=3), _adapters(8, seed=4))
    x = jax.random.normal(jax.random.key(7), (4, 8, EMBED))
    y, (d_moe, d_x) = _output_and_grads(moe, x)
    p = parallel.make_parallelism(mesh)
    with parallel.activate(p):
        sharded = parallel.shard(moe, p)
        assert sharded.experts.gate.adapter.a.sharding.spec[0] == "expert"
        assert "all_to_all" in str(jax.make_jaxpr(sharded)(x)), "the layer must run with expert parallelism"
        y_mesh, (d_mesh, d_x_mesh) = _output_and_grads(sharded, x)
    _close(np.asarray(y_mesh), np.asarray(y), 1e-5, f"{mesh}: output")
    _close(np.asarray(d_x_mesh), np.asarray(d_x), 5e-5, f"{mesh}: d x")
    leaves = jax.tree_util.tree_leaves_with_path(d_moe)
    for (path, want), got in zip(leaves, jax.tree.leaves(d_mesh), strict=True):
        _close(np.asarray(got), np.asarray(want), 5e-5, f"{mesh}: d{jax.tree_util.keystr(path)}")
