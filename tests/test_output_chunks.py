"""The output layer and its loss taken in chunks of positions (``ModelConfig.output_chunk``): the loss terms of a
NumPy re-derivation, the gradients of the whole-sequence step, and a compiled step that holds less."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe import presets
from eqmoe.train.step import Batch, batch_loss

BASE = presets.get("qwen3-moe-micro")
CONFIG = BASE.replace(
    vocab_size=300, tie_embeddings=True, loss=dataclasses.replace(BASE.loss, output_z_loss_weight=0.1)
)
SEQ = 23  # chunks of 5 leave a partial last chunk


def _batch(seed: int = 0) -> Batch:
    tokens = jax.random.randint(jax.random.key(seed), (3, SEQ), 0, CONFIG.vocab_size, jnp.int32)
    segments = np.ones((3, SEQ), np.int32)
    segments[0, 15:] = 2  # two documents in one row
    segments[1, 18:] = 0  # padding
    positions = np.where(segments[0] == 2, np.arange(SEQ) - 15, np.arange(SEQ))
    target = segments > 0
    target[2, :6] = False  # a prompt the loss skips
    return Batch(
        tokens=tokens,
        segment_ids=jnp.asarray(segments),
        positions=jnp.asarray(np.broadcast_to(positions, (3, SEQ)).astype(np.int32)),
        target_mask=jnp.asarray(target),
    )


def _numpy_terms(model, batch: Batch) -> tuple[float, float]:
    """Cross-entropy and output z-loss from the model's final hidden states in float64: logits = h @ E^T."""
    hidden = np.asarray(
        model(batch.tokens, segment_ids=batch.segment_ids, positions=batch.positions, logits=False).hidden, np.float64
    )
    logits = hidden @ np.asarray(model.embed, np.float64).T
    top = logits.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    tokens, keep = np.asarray(batch.tokens), np.asarray(batch.target_mask)[:, 1:]
    target = np.take_along_axis(logits[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    return float(((lse[:, :-1] - target) * keep).sum() / keep.sum()), float(
        (lse[:, :-1] ** 2 * keep).sum() / keep.sum()
    )


@pytest.mark.parametrize("chunk", [5, 64])  # a partial last chunk; one chunk longer than the rows
def test_chunked_terms_equal_numpy_and_gradients_equal_the_whole_sequence(chunk):
    from eqmoe.model import Transformer

    whole = Transformer(CONFIG, key=jax.random.key(1))
    chunked = whole.with_config(CONFIG.replace(output_chunk=chunk))
    batch = _batch()
    run = eqx.filter_jit(eqx.filter_value_and_grad(lambda model, batch: batch_loss(model, batch), has_aux=True))
    (loss, (terms, _)), grads = run(chunked, batch)
    (whole_loss, (whole_terms, _)), whole_grads = run(whole, batch)
    cross_entropy, z = _numpy_terms(whole, batch)
    np.testing.assert_allclose(terms["cross_entropy"], cross_entropy, rtol=1e-5)
    np.testing.assert_allclose(terms["output_z_loss"], z, rtol=1e-5)
    np.testing.assert_allclose(loss, whole_loss, rtol=1e-6)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(grads, eqx.is_array)),
        jax.tree.leaves(eqx.filter(whole_grads, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, atol=1e-6 * max(1.0, float(np.abs(b).max())))


def test_a_chunked_step_compiles_to_less_memory_at_a_wide_vocabulary():
    from eqmoe.model import Transformer

    config = CONFIG.replace(vocab_size=32_000)
    batch = jax.tree.map(lambda x: jnp.tile(x, (2, 8))[:, :128], _batch())  # 6 x 128 tokens
    temps = {}
    for chunk in (0, 16):
        model = Transformer(config.replace(output_chunk=chunk), key=jax.random.key(1))
        step = eqx.filter_jit(eqx.filter_grad(lambda model, batch: batch_loss(model, batch)[0]))
        temps[chunk] = step.lower(model, batch).compile().compiled.memory_analysis().temp_size_in_bytes
    logits = 6 * 128 * 32_000 * 4  # one float32 copy of the whole sequence's logits: 98 MB
    assert temps[16] < temps[0] - logits, temps  # XLA:CPU: 218 MB -> 47 MB


def test_output_chunk_is_refused_in_one_line_when_not_a_count():
    with pytest.raises(ValueError, match="output_chunk"):
        CONFIG.replace(output_chunk=-1)
