"""Variant registries: one registry per family is the config's allowed values, its validation, what runs
and (for dispatch backends) what the planner estimates. A new variant is a function and one registration;
an unregistered name is refused wherever parts are looked up (:func:`eqmoe.registries.check_names`: the model,
overrides, every command), naming the registered ones; the config itself is pure data."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe import Transformer, parallel, presets
from eqmoe.analysis import plan
from eqmoe.config import AttentionConfig, LossConfig, MoEConfig, NormConfig, RouterConfig
from eqmoe.config_io import apply_overrides
from eqmoe.losses import LOAD_BALANCE, objective
from eqmoe.nn import attention_backends, block, dispatch
from eqmoe.nn._init import Init
from eqmoe.nn.router import STRATEGIES, Router, Strategy
from eqmoe.registries import check_names
from eqmoe.registry import Registry
from experiments import plan as plan_cli
from experiments import pretrain

# --- the Registry itself --------------------------------------------------------------------------------


def test_registry_registers_once_looks_up_and_names_the_allowed_values():
    colours: Registry[int] = Registry("colour")
    colours.register("red", 1)

    @colours.register("green")
    def green():
        return 2

    assert colours.get("red") == 1 and colours.get("green") is green
    assert colours.names() == ("red", "green") and "red" in colours and "blue" not in colours and 3 not in colours
    with pytest.raises(ValueError, match="colour 'red' is already registered"):
        colours.register("red", 3)
    with pytest.raises(ValueError, match=r"unknown colour 'blue'; allowed: red \| green"):
        colours.get("blue")
    with pytest.raises(ValueError, match=r"^Paint.colour='blue' is invalid; allowed: red \| green \| auto$"):
        colours.check("Paint", "colour", "blue", extra=("auto",))
    colours.check("Paint", "colour", "auto", extra=("auto",))
    with colours.registered("blue", 4):
        assert colours.get("blue") == 4
    assert "blue" not in colours
    assert colours.unregister("green") is green and colours.names() == ("red",)


# --- router strategies ----------------------------------------------------------------------------------

CALLS = []


def lowest_k(logits, config, bias):
    """Test strategy: the ``top_k`` experts with the *lowest* logits, softmax over them."""
    CALLS.append(config.top_k)
    weights, experts = jax.lax.top_k(-logits, config.top_k)
    return jax.nn.softmax(-weights, axis=-1), experts


def test_a_registered_strategy_trains_through_pretrain_override(tmp_path):
    CALLS.clear()
    with STRATEGIES.registered("lowest_k", Strategy(lowest_k)):
        args = pretrain.Args(
            model=pretrain.ModelOptions(override=("moe.router.strategy=lowest_k",)),
            data=pretrain.DataOptions(seq_len=32, batch_size=2, chars_per_domain=2_000, eval_chars_per_domain=500),
            run=pretrain.RunOptions(steps=2, out_dir=tmp_path, checkpoint_every=2, eval_every=2, log_every=1),
        )
        summary = pretrain.run(args)
        assert CALLS, "the registered strategy never ran"
        assert summary["config"]["moe"]["router"]["strategy"] == "lowest_k"
        assert np.isfinite(summary["final_loss"])
        saved = json.loads((tmp_path / "summary.json").read_text())
        assert saved["overrides"] == {"moe.router.strategy": "lowest_k"}

        key1 = jax.random.key(1)
        # It is the strategy that routes: each token's experts are its lowest-logit ones, not the default's.
        init, key, x = Init("normal", 1.0, jnp.dtype("float32")), jax.random.key(0), jax.random.normal(key1, (8, 16))
        router = Router(16, RouterConfig(num_experts=8, top_k=2, strategy="lowest_k"), init=init, key=key)
        routing = router(x, jnp.ones(8, bool))
        np.testing.assert_array_equal(routing.experts, jax.lax.top_k(-(x @ router.gate.weight), 2)[1])
        default = Router(16, RouterConfig(num_experts=8, top_k=2), init=init, key=key)
        assert not np.array_equal(routing.experts, default(x, jnp.ones(8, bool)).experts)
    with pytest.raises(ValueError, match="allowed: softmax_top_k"):
        apply_overrides(presets.get("qwen3-moe-micro"), {"moe.router.strategy": "lowest_k"})


def test_an_unregistered_strategy_is_refused_naming_the_registered_ones():
    allowed = " | ".join(STRATEGIES.names())
    assert allowed.startswith("softmax_top_k | top_k_softmax | top2_gating | sigmoid_top_k")
    config = apply_overrides(presets.get("qwen3-moe-micro"), {})
    with pytest.raises(ValueError) as excinfo:
        check_names(config.replace(moe=MoEConfig(RouterConfig(num_experts=4, top_k=2, strategy="lowest_k"), 8)))
    assert str(excinfo.value) == f"RouterConfig.strategy='lowest_k' is invalid; allowed: {allowed}"
    with pytest.raises(ValueError) as excinfo:
        apply_overrides(presets.get("qwen3-moe-micro"), {"moe.router.strategy": "lowest_k"})
    assert str(excinfo.value) == (
        f"override moe.router.strategy='lowest_k': RouterConfig.strategy='lowest_k' is invalid; allowed: {allowed}"
    )


def test_a_strategy_check_lives_with_its_registration():
    assert STRATEGIES.get("top2_gating").check is not None
    base = presets.get("qwen3-moe-micro")

    def routed(router: RouterConfig):
        return base.replace(moe=MoEConfig(router, 8))

    with pytest.raises(ValueError, match="top_k=3 is invalid; allowed: 2 with strategy='top2_gating'"):
        check_names(routed(RouterConfig(num_experts=4, top_k=3, strategy="top2_gating")))

    def needs_one(config):
        if config.top_k != 1:
            raise ValueError(f"RouterConfig.top_k={config.top_k} is invalid; allowed: 1 with strategy='first'")

    with STRATEGIES.registered("first", Strategy(lowest_k, check=needs_one)):
        check_names(routed(RouterConfig(num_experts=4, top_k=1, strategy="first")))
        with pytest.raises(ValueError, match="allowed: 1 with strategy='first'"):
            check_names(routed(RouterConfig(num_experts=4, top_k=2, strategy="first")))


# --- dispatch backends ----------------------------------------------------------------------------------

EXTRA_BYTES = 12_345.0


def _dense_again(x, routing, params, config):
    return dispatch.dense(x, routing, params, config)


def _estimate(config, tokens, embed_dim, expert_dim, c):
    return dispatch.BACKENDS.get("dense").estimate(config, tokens, embed_dim, expert_dim, c) + EXTRA_BYTES


def test_a_registered_backend_runs_like_dense_and_is_planned_by_its_own_estimate(capsys):
    base = presets.get("qwen3-moe-micro")
    dense_config = apply_overrides(base, {"moe.dispatch": "dense"})
    with dispatch.BACKENDS.registered("dense_again", dispatch.Backend(_dense_again, _estimate)):
        config = apply_overrides(base, {"moe.dispatch": "dense_again"})
        assert dispatch.resolve(config.moe) is _dense_again
        tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, base.vocab_size)
        model = Transformer(config, key=jax.random.key(0))
        reference = Transformer(dense_config, key=jax.random.key(0))
        np.testing.assert_array_equal(eqx.filter_jit(model)(tokens).logits, eqx.filter_jit(reference)(tokens).logits)

        p = parallel.make_parallelism("data=1", devices=jax.devices()[:1])
        batch, seq = 4, 32
        mine, dense = plan.estimate(config, p, batch, seq), plan.estimate(dense_config, p, batch, seq)
        moe_layers = config.ffn_kinds().count("moe")
        assert mine.activations - dense.activations == pytest.approx(batch * seq * moe_layers * EXTRA_BYTES)

        args = plan_cli.Args(
            preset="qwen3-moe-micro", batch_size=batch, seq_len=seq, dispatch="dense_again", compile=False
        )
        assert plan_cli.main(args) == 0
        capsys.readouterr()
    # Once unregistered, the name is refused, never planned with another backend's estimate.
    with pytest.raises(ValueError, match="MoEConfig.dispatch='dense_again' is invalid; allowed: dense"):
        plan.estimate(config, p, batch, seq)
    assert plan_cli.main(plan_cli.Args(dispatch="dense_again", compile=False)) == 2
    assert "allowed: auto | dense | sorted | ragged_dot | capacity" in capsys.readouterr().err


def test_an_unregistered_backend_is_refused_where_backends_are_looked_up():
    base = presets.get("qwen3-moe-micro")
    unregistered = base.replace(moe=MoEConfig(RouterConfig(4, 2), 8, dispatch="dense_again"))  # pure data: built
    with pytest.raises(ValueError) as excinfo:
        check_names(unregistered)
    assert str(excinfo.value) == (
        "MoEConfig.dispatch='dense_again' is invalid; allowed: dense | sorted | ragged_dot | capacity | gmm | auto"
    )
    with pytest.raises(ValueError, match="MoEConfig.dispatch='dense_again' is invalid"):
        Transformer(unregistered, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"override moe.dispatch='dense_again': .*allowed: dense \| sorted"):
        apply_overrides(base, {"moe.dispatch": "dense_again"})
    with pytest.raises(ValueError, match="MoEConfig.dispatch='capacity' is invalid"):  # the backend's own check
        check_names(base.replace(moe=MoEConfig(RouterConfig(4, 2), 8, dispatch="capacity")))


# --- load-balance forms, attention backends, norm placements ---------------------------------------------


def test_load_balance_forms_are_registered_reported_and_trained():
    with pytest.raises(ValueError) as excinfo:
        check_names(presets.get("qwen3-moe-micro").replace(loss=LossConfig(load_balance="global")))
    assert str(excinfo.value) == (
        "LossConfig.load_balance='global' is invalid; allowed: "
        "hf_pooled | axlearn_top1 | maxtext_sequence | micro_batch"
    )
    base = presets.get("qwen3-moe-micro")
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, base.vocab_size)
    output = Transformer(base, key=jax.random.key(0))(tokens)
    mask = jnp.ones(tokens.shape, bool)
    with LOAD_BALANCE.registered("max_load", lambda aux: jnp.max(aux.load)):
        config = apply_overrides(base, {"loss.load_balance": "max_load"})
        _, terms = objective(output, tokens, mask, config)
        assert {f"load_balance_{name}" for name in LOAD_BALANCE.names()} <= set(terms)
        assert terms["load_balance"] == terms["load_balance_max_load"] == jnp.max(output.aux.load)
    _, terms = objective(output, tokens, mask, base)
    assert "load_balance_max_load" not in terms and terms["load_balance"] == terms["load_balance_hf_pooled"]


def test_attention_backends_and_norm_placements_come_from_their_registries():
    assert attention_backends.BACKENDS.names() == ("blockwise", "dense", "cudnn", "splash")
    base = presets.get("qwen3-moe-micro")
    with pytest.raises(ValueError) as excinfo:
        check_names(base.replace(attention=AttentionConfig(4, 2, 8, backend="flash3")))
    allowed = "blockwise | dense | cudnn | splash | auto"
    assert str(excinfo.value) == f"AttentionConfig.backend='flash3' is invalid; allowed: {allowed}"
    assert block.PLACEMENTS.names() == ("pre", "post", "hybrid")
    with pytest.raises(ValueError) as excinfo:
        check_names(base.replace(norm=NormConfig(ffn_placement="sandwich")))
    assert str(excinfo.value) == "NormConfig.ffn_placement='sandwich' is invalid; allowed: pre | post | hybrid"
    with pytest.raises(ValueError, match=r"override norm.ffn_placement='sandwich': .*allowed: pre \| post \| hybrid"):
        apply_overrides(presets.get("qwen3-moe-micro"), {"norm.ffn_placement": "sandwich"})
