"""What a run does on an accelerator that it does not on a CPU, checked on the CPU: a model drawn on the host, then
put on the default device; a step's terms read back in one go."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqmoe import Transformer, parallel, presets


def test_a_model_drawn_on_the_host_is_the_eager_draw_left_uncommitted_on_the_default_device(monkeypatch):
    config = presets.get("qwen3-moe-micro")
    eager = Transformer(config, key=jax.random.key(3))
    drawn_where = []
    real_normal = jax.random.normal

    def normal(*args, **kwargs):  # where each draw's operands are
        drawn_where.append(jax.config.jax_default_device)
        return real_normal(*args, **kwargs)

    monkeypatch.setattr(parallel.jax, "default_backend", lambda: "tpu")  # as on a TPU machine
    monkeypatch.setattr(jax.random, "normal", normal)
    drawn = parallel.drawn_on_host(lambda: Transformer(config, key=jax.random.key(3)))
    monkeypatch.undo()
    assert drawn_where and all(device == jax.devices("cpu")[0] for device in drawn_where)
    arrays, static = eqx.partition(drawn, eqx.is_array)
    assert bool(eqx.tree_equal(drawn, eager))
    for leaf in jax.tree.leaves(arrays):
        assert not leaf.committed and leaf.devices() == {jax.devices()[0]}
    logits = eqx.filter_jit(lambda m, t: m(t).logits)(drawn, jnp.ones((1, 8), jnp.int32))
    assert np.isfinite(np.asarray(logits)).all()


def test_a_step_terms_come_to_the_host_as_numpy_in_their_tree():
    terms = {"loss": jnp.float32(1.5), "per_layer": jnp.arange(3.0), "label": "x", "nested": (jnp.int32(2),)}
    host = parallel.to_host(terms)
    assert isinstance(host["loss"], np.ndarray | np.generic) and float(host["loss"]) == 1.5
    assert isinstance(host["per_layer"], np.ndarray) and host["per_layer"].tolist() == [0.0, 1.0, 2.0]
    assert host["label"] == "x" and int(host["nested"][0]) == 2
