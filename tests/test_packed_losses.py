"""Packed rows: the per-sequence balance is per document, and padding changes no loss term."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe import presets
from eqmoe.config import MoEConfig, RouterConfig
from eqmoe.losses import LOAD_BALANCE, objective
from eqmoe.model import Transformer
from eqmoe.nn import dispatch
from eqmoe.nn._init import Init
from eqmoe.nn.context import attention_mask
from eqmoe.nn.moe import MoE
from eqmoe.nn.routing_stats import router_stats
from eqmoe.registries import check_names
from tests.parts import context

BASE = presets.get("qwen3-moe-tiny")
TINY = BASE.replace(
    vocab_size=64,
    embed_dim=32,
    attention=dataclasses.replace(BASE.attention, head_dim=8),
    layers=tuple(["dense", "moe", "moe"]),
    mlp_dim=48,
    init_std=0.3,  # a router far from uniform, so per-row and per-document balances differ clearly
)
DOCUMENTS = [9, 5, 3, 7]  # lengths: three documents packed into one row, and one more
SEQ = 20


def _config(backend: str, capacity_factor: float | None = None, num_groups: int = 1):
    router = RouterConfig(8, 2, capacity_factor=capacity_factor, num_groups=num_groups)
    return TINY.replace(moe=MoEConfig(router, expert_dim=16, dispatch=backend, block_size=4))


def _documents(seed: int = 1) -> list[np.ndarray]:
    keys = jax.random.split(jax.random.key(seed), len(DOCUMENTS))
    return [np.asarray(jax.random.randint(k, (n,), 0, TINY.vocab_size)) for k, n in zip(keys, DOCUMENTS, strict=True)]


def _pack(rows: list[list[np.ndarray]], seq: int):
    """Documents packed row by row, right-padded with segment id 0: (tokens, segment_ids, positions)."""
    tokens, segments, positions = (np.zeros((len(rows), seq), np.int32) for _ in range(3))
    for r, documents in enumerate(rows):
        start = 0
        for segment, document in enumerate(documents, start=1):
            end = start + len(document)
            tokens[r, start:end], segments[r, start:end] = document, segment
            positions[r, start:end] = np.arange(len(document))
            start = end
    return tokens, segments, positions


@eqx.filter_jit
def _terms(model, tokens, segments, positions):
    output = model(tokens, segment_ids=segments, positions=positions, token_mask=segments != 0)
    previous = jnp.pad(segments[:, :-1], ((0, 0), (1, 0)))
    target = (segments > 0) & (segments == previous)  # no target at a document's first token
    return objective(output, tokens, target, model.config)[1], output.aux


# --- (a) the per-sequence balance is the mean over documents, each routed alone --------------------------


def test_sequence_balance_is_the_mean_over_packed_documents():
    model = Transformer(_config("sorted"), key=jax.random.key(0))
    documents = _documents()
    rows = [documents[:3], documents[3:]]  # a row of three documents and a row of one, both padded
    packed, packed_aux = _terms(model, *map(jnp.asarray, _pack(rows, SEQ)))

    # Each document alone in a row of its own (one compile for all of them: rows of one document each,
    # no segment ids, so each row is one document; what follows a document is padding).
    alone_rows = _pack([[d] for d in documents], max(DOCUMENTS))
    _, alone_aux = _terms(model, *map(jnp.asarray, alone_rows))
    expected = np.asarray(alone_aux.sequence_balance)  # per MoE layer: the mean over the documents alone
    np.testing.assert_allclose(packed_aux.sequence_balance, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(packed["load_balance_maxtext_sequence"], np.mean(expected), rtol=1e-5)
    # The old per-row form (the first row's three documents pooled as one) is well away from it.
    pooled = _pack([[np.concatenate(documents[:3])], documents[3:]], SEQ)
    _, pooled_aux = _terms(model, *map(jnp.asarray, pooled))
    assert np.all(np.abs(np.asarray(pooled_aux.sequence_balance) - expected) > 1e-3)


def _numpy_sequence_balance(experts, probs, valid, segments, num_experts):
    """MaxText's form per (row, segment) document: E^2 * mean_{documents, e}(density_e * mean P_e)."""
    per_document = []
    for r in range(segments.shape[0]):
        for segment in np.unique(segments[r][valid[r]]):
            at = valid[r] & (segments[r] == segment)
            density = np.stack([(experts[r][at] == e).sum(-1).mean() for e in range(num_experts)])
            per_document.append(density * probs[r][at].mean(0))
    return num_experts**2 * np.mean(per_document)


@pytest.mark.parametrize("with_segments", [True, False])
def test_sequence_balance_matches_a_numpy_derivation(with_segments):
    config = _config("dense").moe
    moe = MoE(16, config, init=Init("normal", 0.5, jnp.dtype("float32")), key=jax.random.key(3))
    batch, seq = 3, 12
    x = jax.random.normal(jax.random.key(4), (batch, seq, 16))
    segments = np.zeros((batch, seq), np.int32)
    segments[0] = [1] * 4 + [2] * 5 + [3] * 2 + [0]
    segments[1] = [1] * 2 + [2] * 10
    # row 2: all padding
    token_mask = segments != 0

    def stats_of(moe, x, segments, valid):
        _, routing = moe(x, context(attention_mask(jnp.zeros_like(valid, jnp.int32), valid)))
        return router_stats(routing, valid, 1, segment_ids=segments)

    stats = eqx.filter_jit(stats_of)(moe, x, jnp.asarray(segments) if with_segments else None, jnp.asarray(token_mask))
    routing = moe.router(x.reshape(-1, 16), jnp.asarray(token_mask).reshape(-1))
    experts = np.asarray(routing.experts).reshape(batch, seq, -1)
    probs = np.asarray(routing.probs, np.float64).reshape(batch, seq, -1)
    documents = segments if with_segments else np.ones_like(segments)
    expected = _numpy_sequence_balance(experts, probs, token_mask, documents, 8)
    np.testing.assert_allclose(stats.sequence_balance, expected, rtol=1e-5)


# --- (b) padding changes no term, for every backend -------------------------------------------------------


def _cases():
    """Every registered backend, dropless and with capacity (1.0: assignments are dropped), where it runs."""
    for name in dispatch.BACKENDS.names():
        for factor in (None, 1.0):
            try:
                check_names(_config(name, factor))
            except ValueError:  # the backend's own check refuses the routing (capacity without a factor)
                continue
            # dense and ragged_dot compute what sorted does (tests/test_stack_and_dispatch.py), gmm what ragged_dot does
            # with the same slots (tests/test_tpu_kernels.py, where its Pallas kernel runs interpreted): -m slow
            marks = [pytest.mark.slow] if name in ("dense", "ragged_dot", "gmm") else []
            label = f"{name}-{'dropless' if factor is None else 'capacity'}"
            yield pytest.param(name, factor, id=label, marks=marks)


@pytest.mark.parametrize(("backend", "capacity_factor"), list(_cases()))
def test_padding_changes_no_loss_term(backend, capacity_factor):
    key = jax.random.key(0)
    model = Transformer(_config(backend, capacity_factor), key=key)
    documents = _documents()[:3]
    base, base_aux = _terms(model, *map(jnp.asarray, _pack([documents], SEQ)))
    assert set(base) >= {f"load_balance_{name}" for name in LOAD_BALANCE.names()} | {
        "cross_entropy",
        "router_z_loss",
        "dropped_fraction",
    }
    if capacity_factor is not None:
        assert float(base_aux.dropped.min()) > 0  # capacity binds: more capacity would change the terms

    variants = {
        "longer row": (model, _pack([documents], SEQ + 12)),
        "padded second row": (model, _pack([documents, []], SEQ)),
        # one group per row: the all-padding group counts in no mean and gives the real row no capacity
        "padded second row, 2 groups": (
            Transformer(_config(backend, capacity_factor, num_groups=2), key=key),
            _pack([documents, []], SEQ),
        ),
    }
    for variant, (variant_model, arrays) in variants.items():
        terms, _ = _terms(variant_model, *map(jnp.asarray, arrays))
        for name, value in base.items():
            np.testing.assert_allclose(terms[name], value, rtol=2e-6, atol=1e-7, err_msg=f"{variant}: {name}")
