"""Per-token routing records and the analyses on them, each against a plain-loop re-derivation on synthetic
routing with known structure, then the recorder on a real model and the analyze_routing command end to end."""

import json
import math
from collections import Counter

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
import pytest

from eqmoe import presets
from eqmoe.analysis.routing_maps import (
    RoutingRecorder,
    RoutingRecords,
    coactivation,
    concat_records,
    cross_layer_agreement,
    domain_routing,
    expert_counts,
    load_report,
    plot_agreement,
    plot_coactivation,
    plot_load,
    plot_vocabulary,
    vocabulary_specialisation,
    write_trace,
)
from eqmoe.checkpoints.model_checkpoint import save_model
from eqmoe.data import ByteTokenizer
from eqmoe.data.corpus import SYNTHETIC_DOMAINS
from eqmoe.losses import next_token_cross_entropy
from eqmoe.model import Transformer
from experiments import analyze_routing


def _records(experts, num_experts, token_ids=None, domains=None, losses=None) -> RoutingRecords:
    """Records of ``experts`` ``[tokens, layers, k]`` with equal weights and one row per 16 tokens."""
    experts = np.asarray(experts, np.int32)
    tokens, layers, k = experts.shape
    return RoutingRecords(
        num_experts=num_experts,
        layers=np.arange(layers, dtype=np.int32),
        token_ids=np.zeros(tokens, np.int32) if token_ids is None else np.asarray(token_ids, np.int32),
        sequences=np.arange(tokens, dtype=np.int32) // 16,
        positions=np.arange(tokens, dtype=np.int32) % 16,
        experts=experts,
        weights=np.full(experts.shape, 1 / k, np.float32),
        kept=np.ones(experts.shape, bool),
        losses=None if losses is None else np.asarray(losses, np.float32),
        domains=None if domains is None else np.asarray(domains, np.int32),
    )


def _two_distinct(rng, choices, tokens):
    """``tokens`` pairs of distinct experts drawn from ``choices``."""
    return np.asarray([rng.choice(choices, 2, replace=False) for _ in range(tokens)])


def _percentile_by_rank(values, q):
    """The linearly interpolated percentile: the sorted values at fractional rank q/100 (n-1)."""
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


def test_load_percentiles_and_dead_experts_of_a_known_distribution():
    # Layer 0: expert e (of 101) gets exactly e top-1 assignments, so expert 0 is dead and the sorted shares are
    # e / 5050, which puts p1, p50 and p99 exactly on experts 1, 50 and 99. Layer 1: tokens round-robin.
    chosen = np.repeat(np.arange(101), np.arange(101))
    experts = np.stack([chosen, np.arange(len(chosen)) % 101], axis=1)[:, :, None]
    records = _records(experts, num_experts=101)
    levels = (1, 37.5, 50, 99)
    report = load_report(records, levels)

    for layer in range(2):
        counts = [0] * 101
        for token in range(records.num_tokens):
            counts[int(experts[token, layer, 0])] += 1
        share = [c / sum(counts) for c in counts]
        np.testing.assert_allclose(report.share[layer], share)
        np.testing.assert_allclose(report.percentiles[layer], [_percentile_by_rank(share, q) for q in levels])
        assert report.dead[layer] == tuple(e for e in range(101) if counts[e] == 0 or share[e] < 1e-3 / 101)
    np.testing.assert_allclose(report.percentiles[0, [0, 2, 3]], np.array([1, 50, 99]) / 5050)
    assert report.dead == ((0,), ())
    # A higher threshold, 5% of the uniform share: experts whose share e/5050 is below 0.05/101.
    assert load_report(records, dead_threshold=0.05).dead[0] == (0, 1, 2)


def test_coactivation_finds_an_expert_pair_that_is_always_chosen_together():
    # 40% of tokens choose experts 0 and 1 (in either order), the rest two of {2, 3, 4}; expert 5 is never chosen.
    rng = np.random.default_rng(0)
    tokens = 1000
    paired = rng.random(tokens) < 0.4
    pairs = np.where(
        paired[:, None], rng.permuted(np.tile([0, 1], (tokens, 1)), axis=1), _two_distinct(rng, [2, 3, 4], tokens)
    )
    records = _records(pairs[:, None, :], num_experts=6)
    result = coactivation(records, pairs=3)

    expected = np.zeros((6, 6))
    for chosen in pairs:
        for i in set(chosen.tolist()):
            for j in set(chosen.tolist()):
                expected[i, j] += 1 / tokens
    np.testing.assert_allclose(result.matrix[0], expected)
    assert result.matrix[0, 0, 1] == result.matrix[0, 0, 0] == result.matrix[0, 1, 1] == paired.mean()
    assert result.conditional[0, 0, 1] == result.conditional[0, 1, 0] == 1.0
    assert not result.matrix[0, 5].any() and not result.conditional[0, 5].any()
    by_frequency = sorted(
        ((expected[i, j], i, j) for i in range(6) for j in range(i + 1, 6) if expected[i, j]), reverse=True
    )
    assert [(i, j) for _, i, j in by_frequency[:3]] == [(i, j) for i, j, _ in result.top_pairs[0]]
    assert result.top_pairs[0][0][:2] == (0, 1)
    assert coactivation(_records(pairs[:, None, :1], num_experts=6)).top_pairs == ((),)  # top-1: no pairs


def _agreement_by_definition(first, second, num_experts):
    """Joint counts, NMI from I = sum p log(p / (p_i p_j)) and H, accuracy sum_i max_j T[i, j] / N."""
    joint = Counter(zip(first.tolist(), second.tolist(), strict=True))
    total = len(first)
    p_first, p_second = Counter(first.tolist()), Counter(second.tolist())
    mutual = sum(n / total * math.log(n * total / (p_first[i] * p_second[j])) for (i, j), n in joint.items())
    h_first = -sum(n / total * math.log(n / total) for n in p_first.values())
    h_second = -sum(n / total * math.log(n / total) for n in p_second.values())
    best = {i: max(joint.get((i, j), 0) for j in range(num_experts)) for i in range(num_experts)}
    return 2 * mutual / (h_first + h_second), sum(best.values()) / total, max(p_second.values()) / total


def test_cross_layer_agreement_of_a_permutation_and_of_independent_choices():
    # Layer 1's top-1 expert is a fixed permutation of layer 0's; layer 2's is drawn independently.
    rng = np.random.default_rng(1)
    tokens, num_experts = 20000, 8
    permutation = rng.permutation(num_experts)
    first = _two_distinct(rng, np.arange(num_experts), tokens)
    second = np.stack([permutation[first[:, 0]], permutation[first[:, 1]]], axis=1)
    third = _two_distinct(rng, np.arange(num_experts), tokens)
    records = _records(np.stack([first, second, third], axis=1), num_experts)
    result = cross_layer_agreement(records)

    for pair in range(2):
        top1 = records.experts[:, :, 0]
        nmi, accuracy, baseline = _agreement_by_definition(top1[:, pair], top1[:, pair + 1], num_experts)
        np.testing.assert_allclose(
            [result.nmi[pair], result.accuracy[pair], result.baseline[pair]], [nmi, accuracy, baseline], rtol=1e-9
        )
        for i in range(num_experts):
            seen = [j for a, j in zip(top1[:, pair], top1[:, pair + 1], strict=True) if a == i]
            for j in range(num_experts):
                assert result.conditional[pair, i, j] == pytest.approx(seen.count(j) / len(seen))
    assert result.accuracy[0] == 1.0 and result.nmi[0] == pytest.approx(1.0)
    np.testing.assert_array_equal(result.conditional[0], np.eye(num_experts)[permutation])
    assert result.nmi[1] < 0.01 and abs(result.accuracy[1] - result.baseline[1]) < 0.03


def test_vocabulary_specialisation_finds_the_expert_that_owns_a_token():
    # Token 7 always goes to expert 3 (at either rank); every other token id picks two random experts.
    rng = np.random.default_rng(2)
    tokens, num_experts = 3000, 6
    token_ids = rng.choice([2, 5, 7, 11, 13], tokens)
    experts = _two_distinct(rng, np.arange(num_experts), tokens)
    owned = token_ids == 7
    experts[owned] = [rng.permutation([3, rng.choice([0, 1, 2, 4, 5])]) for _ in range(owned.sum())]
    records = _records(np.stack([experts, experts[:, ::-1]], axis=1), num_experts, token_ids)
    result = vocabulary_specialisation(records, top_n=2)

    assignments = Counter()  # (token id, expert) -> assignments, layer 0 (layer 1 routes identically)
    for token, chosen in zip(token_ids.tolist(), experts.tolist(), strict=True):
        for expert in chosen:
            assignments[token, expert] += 1
    ids = sorted(set(token_ids.tolist()))
    np.testing.assert_array_equal(result.token_ids, ids)
    np.testing.assert_array_equal(result.token_counts, [int((token_ids == i).sum()) for i in ids])
    best_total = 0
    for index, token in enumerate(ids):
        counts = [assignments[token, e] for e in range(num_experts)]
        best = counts.index(max(counts))
        best_total += counts[best]
        assert result.token_expert[0, index] == result.token_expert[1, index] == best
        assert result.token_fraction[0, index] == pytest.approx(counts[best] / (token_ids == token).sum())
    assert result.specialisation[0] == pytest.approx(best_total / tokens)
    for expert in range(num_experts):
        ranked = sorted(ids, key=lambda token, e=expert: (-assignments[token, e], token))[:2]
        assert result.top_tokens[0, expert].tolist() == ranked
        assert result.top_counts[0, expert].tolist() == [assignments[t, expert] for t in ranked]
        total = sum(assignments[t, expert] for t in ids)
        assert result.top_share[0, expert] == pytest.approx(sum(assignments[t, expert] for t in ranked) / total)
    seven = ids.index(7)
    assert result.token_expert[0, seven] == 3 and result.token_fraction[0, seven] == 1.0
    assert result.top_tokens[0, 3, 0] == 7


def test_domain_routing_counts_nmi_and_loss_per_domain():
    # Domain 0 uses experts {0, 1}, domain 1 experts {2, 3}; tokens of domain -1 and NaN losses are left out.
    domains = np.array([0, 0, 1, 1, 1, -1, 0])
    experts = np.array([[0, 1], [1, 0], [2, 3], [3, 2], [2, 3], [0, 2], [0, 1]])[:, None, :]
    losses = np.array([np.nan, 2.0, 1.0, 3.0, np.nan, 9.0, 4.0])
    result = domain_routing(_records(experts, 4, domains=domains, losses=losses))

    counts = np.zeros((2, 4), int)
    for domain, chosen in zip(domains, experts[:, 0], strict=True):
        if domain >= 0:
            for expert in chosen:
                counts[domain, expert] += 1
    np.testing.assert_array_equal(result.counts[0], counts)
    np.testing.assert_array_equal(result.tokens, [3, 3])
    np.testing.assert_allclose(result.loss, [(2.0 + 4.0) / 2, (1.0 + 3.0) / 2])
    assert result.nmi[0] == pytest.approx(2 / 3)  # I = H(domain) = ln 2 and H(expert) = ln 4: 2 ln 2 / 3 ln 2
    with pytest.raises(ValueError, match="no domains"):
        domain_routing(_records(experts, 4))


def test_trace_files_hold_one_row_per_token_and_layer(tmp_path):
    rng = np.random.default_rng(3)
    records = _records(_two_distinct(rng, np.arange(4), 30).reshape(10, 3, 2), 4, token_ids=np.arange(10) + 100)
    records = records._replace(layers=np.array([1, 3, 5], np.int32))
    for name in ("trace.jsonl", "trace.parquet"):
        path = write_trace(records, tmp_path / name)
        rows = (
            [json.loads(line) for line in path.read_text().splitlines()]
            if name.endswith("jsonl")
            else pq.read_table(path).to_pylist()
        )
        assert len(rows) == 30
        for row_number, row in enumerate(rows):
            token, layer = divmod(row_number, 3)
            assert row["token_id"] == 100 + token and row["position"] == token and row["layer"] == 2 * layer + 1
            assert list(row["experts"]) == records.experts[token, layer].tolist()
            assert list(row["weights"]) == pytest.approx([0.5, 0.5])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.jsonl", "trace.parquet"]  # no temporary left
    for plot, result in [
        (plot_load, load_report(records)),
        (plot_coactivation, coactivation(records)),
        (plot_agreement, cross_layer_agreement(records)),
        (plot_vocabulary, vocabulary_specialisation(records)),
    ]:
        plot(result, records.layers.tolist()).savefig(tmp_path / "figure.png")


@pytest.fixture(scope="module")
def model():
    """qwen3-moe-micro with dense and MoE blocks interleaved: its MoE layers are model layers 1 and 3."""
    config = presets.get("qwen3-moe-micro").replace(layers=("dense", "moe") * 2)
    return Transformer(config, key=jax.random.key(0))


def test_recorder_sees_what_the_router_statistics_count(model):
    config = model.config  # row 1 of the batch ends in padding
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (2, 24), 0, config.vocab_size), np.int32)
    mask = np.ones((2, 24), bool)
    mask[1, 15:] = False
    recorder = RoutingRecorder(model)
    records = concat_records([recorder(tokens, token_mask=mask), recorder(tokens)])  # one shape: one compile

    forward = eqx.filter_jit(lambda model, tokens, mask: model(tokens, token_mask=mask))
    output = forward(model, jnp.asarray(tokens), jnp.asarray(mask))
    first = records.sequences < 2
    np.testing.assert_array_equal(records.layers, [1, 3])
    assert records.num_tokens == 39 + 48 and records.experts.shape[1:] == (2, config.moe.router.top_k)
    np.testing.assert_array_equal(
        expert_counts(records._replace(experts=records.experts[first])), np.asarray(output.aux.expert_counts)
    )
    np.testing.assert_array_equal(records.experts[~first][:24], records.experts[:24])  # same row, same routing
    np.testing.assert_array_equal(records.sequences[~first], np.repeat([2, 3], 24))
    np.testing.assert_allclose(records.weights.sum(-1), 1.0, rtol=1e-5)  # renormalised top-k weights
    np.testing.assert_array_equal(records.token_ids[first], tokens[mask])
    np.testing.assert_array_equal(records.positions[first], np.nonzero(mask)[1])
    target = np.zeros_like(mask)
    target[:, 1:] = mask[:, 1:]
    loss = next_token_cross_entropy(output.logits, jnp.asarray(tokens), jnp.asarray(target))
    assert np.isnan(records.losses[records.positions == 0]).all()
    assert np.nanmean(records.losses[first]) == pytest.approx(float(loss), rel=1e-5)


def test_analyze_routing_end_to_end(model, tmp_path, capsys):
    checkpoint = save_model(model, tmp_path / "model")
    data = tmp_path / "data.jsonl"
    lines = [{"text": f"{a}+{b}={a + b}\n" * 3, "domain": "sums"} for a, b in zip(range(8), range(10, 18), strict=True)]
    lines += [{"text": "the cat sees a robot near the hill .\n" * 2, "domain": "words"}] * 6
    data.write_text("\n".join(map(json.dumps, lines)))
    out = tmp_path / "out"
    args = analyze_routing.Args(
        checkpoint=checkpoint, data=(data,), tokens=300, batch_size=4, seq_len=64, out_dir=out, trace="jsonl"
    )
    assert analyze_routing.main(args) == 0
    printed = capsys.readouterr().out
    assert "2 MoE layers x 8 experts (top-2)" in printed and "per-domain loss: sums" in printed

    summary = json.loads((out / "routing.json").read_text())
    expected = {"layers", "num_experts", "top_k", "tokens", "load", "coactivation", "agreement", "vocabulary"}
    assert expected | {"domains", "figures", "trace"} <= summary.keys()
    assert summary["layers"] == [1, 3] and summary["tokens"] >= 300
    share = np.asarray(summary["load"]["share"])
    np.testing.assert_allclose(share.sum(-1), 1.0, rtol=1e-5)
    for name in ("p1", "p50", "p99"):
        values = np.asarray(summary["load"]["percentiles"][name])
        assert ((share.min(-1) - 1e-6 <= values) & (values <= share.max(-1) + 1e-6)).all()
    diagonal = np.diagonal(np.asarray(summary["coactivation"]["matrix"]), axis1=1, axis2=2)
    np.testing.assert_allclose(diagonal, share * summary["top_k"], rtol=1e-4)  # k distinct experts per token
    assert [pair["layers"] for pair in summary["agreement"]] == [[1, 3]] and 0 <= summary["agreement"][0]["nmi"] <= 1
    assert summary["domains"]["names"] == ["sums", "words"]
    assert sum(summary["domains"]["tokens"]) == summary["tokens"]
    assert len((out / "trace.jsonl").read_text().splitlines()) == summary["tokens"] * 2
    assert {p.name for p in out.iterdir()} == {"routing.json", "trace.jsonl", *summary["figures"]}
    assert len(summary["figures"]) == 5


def test_the_default_data_is_the_built_in_held_out_corpus_with_every_domain():
    args = analyze_routing.Args(tokens=2000, chars_per_domain=3000, seq_len=64)
    rows, labels, domains, note = analyze_routing.packed_rows(args, ByteTokenizer())
    assert domains == SYNTHETIC_DOMAINS and "held-out" in note
    assert 2000 <= (rows.segment_ids > 0).sum() < 2000 + 64
    assert set(labels[rows.segment_ids > 0].tolist()) == set(range(len(domains)))  # the sample mixes domains


def test_analyze_routing_reports_a_missing_checkpoint_in_one_line(tmp_path, capsys):
    args = analyze_routing.Args(checkpoint=tmp_path / "nothing", out_dir=tmp_path / "out")
    assert analyze_routing.main(args) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "nothing: model folder not found" in error
    assert analyze_routing.main(analyze_routing.Args(out_dir=tmp_path / "out")) == 2
    error = capsys.readouterr().err
    assert "give one of" in error and "--checkpoint DIR" in error
    assert not (tmp_path / "out").exists()
