"""LoRA as a model transformation: an adapted model against its weights merged in NumPy, and adapter gradients
against the merged-weight gradient (dL/dA = s dL/dW B^T, dL/dB = s A^T dL/dW)."""

import dataclasses
import zlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe import presets
from eqmoe.lora import LoRAConfig, add_lora, has_lora, lora_targets, merge_lora
from eqmoe.model import Transformer
from eqmoe.nn.mlp import SwiGLU
from eqmoe.params import ParamInfo, Role, param_info

BASE = presets.get("qwen3-moe-tiny")
TINY = BASE.replace(
    vocab_size=64,
    embed_dim=32,
    attention=dataclasses.replace(BASE.attention, head_dim=8),
    layers=tuple(["dense", "moe", "moe"]),
    mlp_dim=48,
    moe=dataclasses.replace(BASE.moe, expert_dim=16, dispatch="dense"),
)
TARGETS = ("attention", "mlp", "router")  # routed experts: tests/test_lora_experts.py
SCALE = 2.0  # alpha 8 / rank 4


def _adapted(seed: int = 0):
    model = Transformer(TINY, key=jax.random.key(seed))
    adapted = add_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=TARGETS), key=jax.random.key(1))
    return model, adapted


def _randomised_b(adapted):
    def randomise(path, leaf):
        name = jax.tree_util.keystr(path)
        if name.endswith("_b") or name.endswith(".b"):
            # crc32 rather than hash(): str hashes change with each process, and so would the test
            return 0.1 * jax.random.normal(jax.random.key(zlib.crc32(name.encode())), leaf.shape, leaf.dtype)
        return leaf

    lora_nodes = lambda m: [x for x in jax.tree.leaves(m, is_leaf=lambda n: hasattr(n, "scale")) if hasattr(x, "scale")]  # noqa: E731,E501
    return eqx.tree_at(
        lora_nodes, adapted, [jax.tree_util.tree_map_with_path(randomise, n) for n in lora_nodes(adapted)]
    )


def _numpy_merged(model, adapted):
    """The base model with each adapted weight replaced by W + s A @ B computed in NumPy."""
    pairs = {"attention": ("q", "k", "v", "o"), "mlp": ("gate", "up", "down")}  # each matrix, its adapter beside it
    merged = model
    for s, (unit, adapted_unit) in enumerate(zip(model.segments, adapted.segments, strict=True)):
        for j, (block, adapted_block) in enumerate(zip(unit.blocks, adapted_unit.blocks, strict=True)):
            targets = [("attention", block.attention, adapted_block.attention)]
            if isinstance(block.ffn, SwiGLU):
                targets.append(("mlp", block.ffn, adapted_block.ffn))
            for group, layer, adapted_layer in targets:
                for member in pairs[group]:
                    w = np.asarray(getattr(layer, member).weight, np.float64)
                    a = np.asarray(getattr(adapted_layer, member).adapter.a, np.float64)
                    b = np.asarray(getattr(adapted_layer, member).adapter.b, np.float64)
                    layers = w.shape[0]
                    delta = np.stack([a[i].reshape(-1, 4) @ b[i].reshape(4, -1) for i in range(layers)])
                    new = (w + SCALE * delta.reshape(w.shape)).astype(np.float32)
                    merged = eqx.tree_at(
                        lambda m, s=s, j=j, g=group, n=member: getattr(_layer(m, s, j, g), n).weight, merged, new
                    )
            if hasattr(block.ffn, "router"):
                router, adapted_router = block.ffn.router, adapted_block.ffn.router
                w = np.asarray(router.gate.weight, np.float64)
                adapter = adapted_router.gate.adapter
                a, b = np.asarray(adapter.a, np.float64), np.asarray(adapter.b, np.float64)
                new = (w + SCALE * np.einsum("lir,lro->lio", a, b)).astype(np.float32)
                merged = eqx.tree_at(lambda m, s=s, j=j: m.segments[s].blocks[j].ffn.router.gate.weight, merged, new)
    return merged


def _layer(model, s, j, group):
    block = model.segments[s].blocks[j]
    return block.attention if group == "attention" else block.ffn


@eqx.filter_jit
def _logits(model, tokens):
    return model(tokens).logits


@eqx.filter_jit
def _loss(model, tokens):
    logits = model(tokens).logits
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0])


TOKENS = jax.random.randint(jax.random.key(5), (2, 12), 0, 64)


def test_a_fresh_adapter_changes_nothing_and_targets_are_checked():
    model, adapted = _adapted()
    assert has_lora(adapted) and not has_lora(model)
    np.testing.assert_allclose(
        _logits(model, TOKENS), _logits(adapted, TOKENS), atol=1e-6
    )  # B = 0 (XLA may fuse differently)
    roles = {info.role for info in jax.tree.leaves(param_info(adapted))}
    assert Role.ADAPTER in roles
    assert "experts.down" in lora_targets() and "attention.q" in lora_targets()
    for bad, message in [
        (dict(rank=0), "rank=0 is invalid"),
        (dict(targets=("attn",)), "unknown 'attn'"),
        (dict(alpha=0.0), "alpha=0.0 is invalid"),
    ]:
        with pytest.raises(ValueError, match=message):
            LoRAConfig(**bad)
    all_moe = Transformer(TINY.replace(layers=tuple(["moe"])), key=jax.random.key(0))
    with pytest.raises(ValueError, match="no mlp layer"):
        add_lora(all_moe, LoRAConfig(targets=("mlp",)), key=jax.random.key(0))


def test_adapted_model_equals_numpy_merged_weights_and_merge_lora():
    model, adapted = _adapted()
    adapted = _randomised_b(adapted)
    reference = _numpy_merged(model, adapted)
    logits = _logits(adapted, TOKENS)
    assert float(jnp.max(jnp.abs(logits - _logits(model, TOKENS)))) > 1e-3  # the adapters matter
    np.testing.assert_allclose(logits, _logits(reference, TOKENS), atol=2e-5)
    merged = merge_lora(adapted)
    assert not has_lora(merged)
    np.testing.assert_allclose(_logits(merged, TOKENS), _logits(reference, TOKENS), atol=2e-5)


def _assert_close_to_scale(got, want):
    """float32 rounding of each entry scales with the tensor's largest terms, not its own size: over twelve seeds
    here the adapter gradients differed by at most 4e-6 of the largest entry, and by 1.3e-5 on another CPU."""
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_adapter_gradients_equal_the_merged_weight_gradient_rederived():
    model, adapted = _adapted()
    adapted = _randomised_b(adapted)
    reference = _numpy_merged(model, adapted)
    grads = eqx.filter_jit(eqx.filter_grad(_loss))(adapted, TOKENS)
    merged_grads = eqx.filter_jit(eqx.filter_grad(_loss))(reference, TOKENS)
    checked = 0
    for s, unit in enumerate(adapted.segments):
        for j, block in enumerate(unit.blocks):
            layers = [("attention", ("q", "k", "v", "o"))]
            if isinstance(block.ffn, SwiGLU):
                layers.append(("mlp", ("gate", "up", "down")))
            for group, members in layers:
                for member in members:
                    lora_grads = getattr(_layer(grads, s, j, group), member).adapter
                    adapters = getattr(_layer(adapted, s, j, group), member).adapter
                    d_w = np.asarray(getattr(_layer(merged_grads, s, j, group), member).weight, np.float64)
                    a = np.asarray(adapters.a, np.float64)
                    b = np.asarray(adapters.b, np.float64)
                    for i in range(d_w.shape[0]):
                        a_i, b_i = a[i].reshape(-1, 4), b[i].reshape(4, -1)
                        d_w_i = d_w[i].reshape(a_i.shape[0], b_i.shape[1])
                        d_a = np.asarray(lora_grads.a)[i].reshape(a_i.shape)
                        d_b = np.asarray(lora_grads.b)[i].reshape(b_i.shape)
                        want_a, want_b = SCALE * d_w_i @ b_i.T, SCALE * a_i.T @ d_w_i
                        _assert_close_to_scale(d_a, want_a)
                        _assert_close_to_scale(d_b, want_b)
                        checked += 1
            if hasattr(block.ffn, "router"):
                d_w = np.asarray(merged_grads.segments[s].blocks[j].ffn.router.gate.weight, np.float64)
                adapter, d_adapter = block.ffn.router.gate.adapter, grads.segments[s].blocks[j].ffn.router.gate.adapter
                a, b = np.asarray(adapter.a, np.float64), np.asarray(adapter.b, np.float64)
                _assert_close_to_scale(d_adapter.a, SCALE * np.einsum("lio,lro->lir", d_w, b))
                _assert_close_to_scale(d_adapter.b, SCALE * np.einsum("lir,lio->lro", a, d_w))
                checked += 1
    assert checked >= 8


# --- training: frozen parameters get no gradient, no optimizer state and no change ---------------------------


def _train(model, optimizer_config, steps: int = 3):
    from eqmoe.train.optimizer import make_optimizer, trained_roles
    from eqmoe.train.state import init_state
    from eqmoe.train.step import Batch, make_train_step

    params = eqx.filter(model, eqx.is_array)
    optimizer, schedule = make_optimizer(optimizer_config, params, embed_dim=TINY.embed_dim)
    step = make_train_step(optimizer, schedule, trained_roles(optimizer_config, params))
    copy = jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, model)  # the step donates its state
    state = init_state(copy, optimizer, key=jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(7), (4, 16), 0, TINY.vocab_size)
    ones = jnp.ones_like(tokens)
    batch = Batch(tokens, ones, jnp.broadcast_to(jnp.arange(16), tokens.shape), ones.astype(bool))
    losses = []
    for _ in range(steps):
        state, terms = step(batch, state)
        losses.append(float(terms["loss"]))
    return state, losses


def _optimizer_floats(state) -> int:
    """Float elements of the optimizer state (Adam's moments; counters are integers)."""
    leaves = jax.tree.leaves(eqx.filter(state.opt_state, eqx.is_array))
    return sum(leaf.size for leaf in leaves if jnp.issubdtype(leaf.dtype, jnp.floating))


def _by_role(model) -> dict:
    infos = jax.tree.leaves(param_info(eqx.filter(model, eqx.is_array)), is_leaf=lambda x: isinstance(x, ParamInfo))
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    return list(zip(infos, leaves, strict=True))


def test_lora_training_trains_adapters_only_and_keeps_no_state_for_the_base():
    from eqmoe.train.optimizer import OptimizerConfig

    _, adapted = _adapted()
    state, losses = _train(adapted, OptimizerConfig(learning_rate=1e-2, warmup_steps=0))
    assert losses[-1] < losses[0]
    adapter_size = sum(leaf.size for info, leaf in _by_role(adapted) if info.role is Role.ADAPTER)
    assert _optimizer_floats(state) == 2 * adapter_size  # Adam's two moments of the adapters, nothing else
    for (info, before), (_, after) in zip(_by_role(adapted), _by_role(state.model), strict=True):
        if info.role is Role.ADAPTER:
            continue
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before))  # bit-identical base
    b_before = [leaf for info, leaf in _by_role(adapted) if info.role is Role.ADAPTER]
    b_after = [leaf for info, leaf in _by_role(state.model) if info.role is Role.ADAPTER]
    assert any(float(jnp.max(jnp.abs(a - b))) > 0 for a, b in zip(b_before, b_after, strict=True))


def test_frozen_roles_keep_no_state_and_do_not_change():
    from eqmoe.train.optimizer import OptimizerConfig

    model = Transformer(TINY, key=jax.random.key(0))
    config = OptimizerConfig(learning_rate=1e-2, warmup_steps=0, freeze=("router", "embeddings"))
    state, _ = _train(model, config)
    frozen = {Role.ROUTER, Role.EMBEDDING}
    trained_size = sum(leaf.size for info, leaf in _by_role(model) if info.role.trained and info.role not in frozen)
    assert _optimizer_floats(state) == 2 * trained_size
    for (info, before), (_, after) in zip(_by_role(model), _by_role(state.model), strict=True):
        changed = bool(np.any(np.asarray(after) != np.asarray(before)))
        assert changed == (info.role.trained and info.role not in frozen), info
    with pytest.raises(ValueError, match="'routers?x' is not a role"):
        OptimizerConfig(freeze=("routerx",))


def test_a_frozen_base_held_in_bfloat16_trains_the_same_numbers():
    from eqmoe.train.optimizer import OptimizerConfig, trained_roles
    from eqmoe.train.state import hold_frozen

    _, adapted = _adapted()
    adapted = adapted.with_config(adapted.config.replace(dtype="bfloat16"))
    config = OptimizerConfig(learning_rate=1e-2, warmup_steps=0)
    held = hold_frozen(adapted, trained_roles(config, eqx.filter(adapted, eqx.is_array)))
    dtypes = {(info.role is Role.ADAPTER, leaf.dtype) for info, leaf in _by_role(held)}
    assert dtypes == {
        (True, jnp.dtype("float32")),
        (False, jnp.dtype("bfloat16")),
    }  # the base in the compute dtype, adapters not
    state_fp32, losses_fp32 = _train(adapted, config, steps=4)
    state_held, losses_held = _train(held, config, steps=4)
    assert losses_held == losses_fp32  # every forward pass casts to bfloat16 first: the same numbers
    for (info, a), (_, b) in zip(_by_role(state_fp32.model), _by_role(state_held.model), strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(b.dtype), np.float32), np.asarray(b, np.float32), str(info))


def _sizes(model) -> tuple[int, int]:
    """(adapter numbers, base numbers) of ``model``."""
    arrays = eqx.filter(model, lambda x: isinstance(x, jax.Array | jax.ShapeDtypeStruct))
    infos = jax.tree.leaves(param_info(arrays), is_leaf=lambda x: isinstance(x, ParamInfo))
    sizes = [(info.role is Role.ADAPTER, leaf.size) for info, leaf in zip(infos, jax.tree.leaves(arrays), strict=True)]
    return sum(n for is_adapter, n in sizes if is_adapter), sum(n for is_adapter, n in sizes if not is_adapter)


def test_rank_8_adapters_are_under_five_percent_of_the_model(tmp_path):
    pytest.importorskip("torch")
    from eqmoe.checkpoints import hf
    from eqmoe.checkpoints.peft import ADAPTER_FILE, save_adapters
    from tests.conftest import save_tiny_hf

    lora = LoRAConfig(rank=8, alpha=16.0, targets=("attention", "experts"))
    # Qwen3-30B-A3B: the adapters, and the adapters with their two Adam moments (what a LoRA run's checkpoint holds).
    shapes = eqx.filter_eval_shape(
        lambda: add_lora(Transformer(presets.get("qwen3-30b-a3b"), key=jax.random.key(0)), lora, key=jax.random.key(1))
    )
    adapters, base = _sizes(shapes)
    assert base == 30_532_122_624  # REFERENCE.md
    assert 3 * adapters < 0.05 * base, (adapters, base)
    print(f"qwen3-30b-a3b rank 8: {adapters:,} adapter parameters, {adapters / base:.2%} of the model")
    # Measured on disk for a model with Qwen3's proportions (the experts' matrices dominate).
    save_tiny_hf(
        tmp_path / "hf",
        vocab_size=1024,
        hidden_size=512,
        moe_intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        num_experts=8,
    )
    model = add_lora(hf.load(tmp_path / "hf"), lora, key=jax.random.key(1))
    save_adapters(model, tmp_path / "adapters")
    adapter_bytes = (tmp_path / "adapters" / ADAPTER_FILE).stat().st_size
    model_bytes = sum(p.stat().st_size for p in (tmp_path / "hf").glob("*.safetensors"))
    assert adapter_bytes < 0.05 * model_bytes, (adapter_bytes, model_bytes)
    print(f"PEFT folder {adapter_bytes:,} bytes, {adapter_bytes / model_bytes:.2%} of the model's {model_bytes:,}")


def test_lora_dropout_drops_adapter_inputs_only_while_training():
    from eqmoe.nn.linear import Linear, LowRank
    from eqmoe.params import Role

    rate, tokens, width = 0.25, 4000, 4
    adapter = LowRank(
        a=jnp.eye(width),
        b=jnp.eye(width),
        scale=1.0,
        dropout=rate,
        lead_axes=(),
        in_axes=("embed",),
        out_axes=("embed",),
    )
    linear = Linear.holding(jnp.zeros((width, width)), None, adapter, role=Role.ATTENTION)
    adapted = lambda x, key=None: linear(x, key)  # noqa: E731
    x = jax.random.normal(jax.random.key(0), (tokens, width)) + 3.0
    np.testing.assert_array_equal(adapted(x), x)  # no key: no dropout (evaluation)
    dropped = np.asarray(adapted(x, jax.random.key(1)))
    # With A = B = I and W = 0 the output is dropout(x): each entry 0 or x / (1 - p), about p of them 0.
    zero = dropped == 0
    np.testing.assert_allclose(dropped[~zero], np.asarray(x)[~zero] / (1 - rate), rtol=1e-6)
    assert abs(zero.mean() - rate) < 0.02
    other = np.asarray(adapted(x, jax.random.key(2)))
    assert np.mean((other == 0) != zero) > 0.2  # another key, another mask
    with pytest.raises(ValueError, match="dropout"):
        LoRAConfig(dropout=1.0)
    model = add_lora(
        Transformer(TINY, key=jax.random.key(0)),
        LoRAConfig(4, 8.0, ("attention", "experts"), 0.1),
        key=jax.random.key(1),
    )
    assert _layer(model, 0, 0, "attention").q.adapter.dropout == 0.1
