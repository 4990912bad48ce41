"""Gradient accumulation takes the step of one large batch: the same rows, the same cross-entropy and gradient,
with one micro-batch's activations held at a time (through sft, with --epochs: tests/test_run_folder.py)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqmoe import Transformer, presets
from eqmoe.config_io import apply_overrides
from eqmoe.data import ByteTokenizer, PackedDataset, encode_chats, pack, synthetic_split
from eqmoe.train.step import accumulated_loss_and_grads, batch_loss, device_batch

SCALARS = ("load_cv", "load_max_over_mean", "max_vio", "router_entropy")
BY_LAYER = ("load_cv", "load_max_minus_min", "max_vio", "router_entropy", "dropped_fraction")


def test_micro_batches_give_the_gradient_of_their_union():
    # cross-entropy only: the router's losses are per batch by definition, and weighted by tokens when accumulated
    config = apply_overrides(presets.get("qwen3-moe-micro"), {"loss.load_balance_weight": 0.0})
    examples = synthetic_split("train", 64, 0)
    pairs = [(e.ids, e.loss_mask) for e in encode_chats([e.messages for e in examples], ByteTokenizer())]
    batch = device_batch(PackedDataset(pack(pairs, 64, 0, overflow="truncate").rows).batch_at(0, 8, 0))
    model = Transformer(config, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    loss_of = lambda p, rows, key: batch_loss(eqx.combine(p, static), rows, key)  # noqa: E731
    (_, (whole, _)), expected = eqx.filter_jit(eqx.filter_value_and_grad(loss_of, has_aux=True))(params, batch, None)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(expected))
    for micro in (2,):  # the train step's path end to end: test_epochs_and_grad_accum_through_sft
        accumulate = eqx.filter_jit(
            lambda p, b, m=micro: accumulated_loss_and_grads(loss_of, p, b, m, jax.random.key(0))
        )
        terms, _, grads = accumulate(params, batch)
        np.testing.assert_allclose(terms["cross_entropy"], whole["cross_entropy"], rtol=1e-6)
        assert terms["target_tokens"] == whole["target_tokens"]
        # routing figures are ratios of the step's summed routing sums, not means of the micro-batches' ratios
        for name in (*SCALARS, *(f"{n}_by_layer" for n in BY_LAYER)):
            np.testing.assert_allclose(terms[name], whole[name], rtol=1e-6, atol=1e-7, err_msg=name)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-6 * scale, rtol=0)
