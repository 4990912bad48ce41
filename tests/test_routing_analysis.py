"""Routing statistics: load balance figures, router entropy and domain-expert mutual information."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe.analysis.routing import accumulate, normalized_mutual_information, summarize
from eqmoe.nn.router import Routing
from eqmoe.nn.routing_stats import router_stats


def _stats(logits, experts, kept):
    logits = jnp.asarray(logits, jnp.float32)
    experts = jnp.asarray(experts)
    routing = Routing(
        weights=jnp.ones(experts.shape),
        experts=experts,
        kept=jnp.asarray(kept),
        positions=jnp.zeros_like(experts),
        logits=logits,
    )
    return router_stats(routing, jnp.ones((1, experts.shape[0]), bool), num_groups=1)


def test_summary_figures_against_hand_computed_values():
    # 4 tokens, top-2 over 3 experts: expert 0 gets 4 assignments, expert 1 gets 3, expert 2 gets 1.
    experts = [[0, 1], [0, 1], [0, 2], [0, 1]]
    kept = [[True, True], [True, False], [True, True], [False, True]]
    logits = np.zeros((4, 3))  # uniform router: entropy log 3 per token
    stats = jax.tree.map(lambda x: x[None], _stats(logits, experts, kept))  # one layer
    summary = summarize(stats)
    load = np.array([4, 3, 1]) / 8
    np.testing.assert_allclose(summary.load[0], load)
    np.testing.assert_allclose(summary.load_cv[0], load.std() / load.mean())
    np.testing.assert_allclose(summary.max_min_ratio[0], 4.0)
    np.testing.assert_allclose(summary.dropped_fraction[0], 2 / 8)
    np.testing.assert_allclose(summary.entropy[0], 1.0, rtol=1e-6)


def test_accumulated_batches_equal_one_batch_and_an_empty_expert_gives_infinite_ratio():
    first = _stats(np.eye(3)[[0, 1]] * 5, [[0], [1]], [[True], [True]])
    second = _stats(np.eye(3)[[0, 0]] * 5, [[0], [0]], [[True], [True]])
    both = _stats(np.eye(3)[[0, 1, 0, 0]] * 5, [[0], [1], [0], [0]], [[True]] * 4)
    total = accumulate(accumulate(None, first), second)
    for got, want in zip(jax.tree.leaves(total)[:4], jax.tree.leaves(both)[:4], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    summary = summarize(jax.tree.map(lambda x: x[None], total))
    assert summary.max_min_ratio[0] == np.inf and summary.entropy[0] < 0.1


def _mutual_information_by_definition(joint):
    """I = sum p(d,e) log(p(d,e) / (p(d) p(e))), normalised by the mean of the marginal entropies."""
    p = joint / joint.sum()
    pd, pe = p.sum(1), p.sum(0)
    mutual = sum(
        p[d, e] * np.log(p[d, e] / (pd[d] * pe[e])) for d in range(p.shape[0]) for e in range(p.shape[1]) if p[d, e]
    )
    hd = -sum(x * np.log(x) for x in pd if x)
    he = -sum(x * np.log(x) for x in pe if x)
    return mutual / ((hd + he) / 2)


@pytest.mark.parametrize("seed", range(5))
def test_mutual_information_matches_its_definition(seed):
    joint = np.random.default_rng(seed).integers(0, 20, (4, 6)).astype(float)
    assert normalized_mutual_information(joint) == pytest.approx(_mutual_information_by_definition(joint))


def test_mutual_information_extremes_and_bad_input():
    assert normalized_mutual_information(np.outer([1, 2, 3], [4, 1, 1, 2])) == pytest.approx(0.0, abs=1e-12)
    assert normalized_mutual_information(np.diag([5.0, 3.0, 2.0])) == pytest.approx(1.0)
    assert normalized_mutual_information(np.zeros((2, 2))) == 0.0
    with pytest.raises(ValueError, match="non-negative"):
        normalized_mutual_information(-np.ones((2, 2)))
