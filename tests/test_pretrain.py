"""Pretraining: the built-in corpus, config overrides, domain-labelled routing statistics and the run's outputs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe import Transformer, presets
from eqmoe.analysis.routing import normalized_mutual_information, summarize
from eqmoe.config_io import apply_overrides, format_override, parse_override
from eqmoe.data import ByteTokenizer
from eqmoe.data.corpus import (
    SYNTHETIC_DOMAINS,
    Document,
    load_documents,
    pack_documents,
    split_documents,
    synthetic_documents,
)
from eqmoe.nn.router import Routing
from eqmoe.nn.routing_stats import router_stats
from experiments import pretrain


def test_synthetic_corpus_is_deterministic_balanced_and_correct():
    train = synthetic_documents("train", 5_000, seed=3)
    assert train == synthetic_documents("train", 5_000, seed=3)
    assert train != synthetic_documents("train", 5_000, seed=4)
    held_out = synthetic_documents("eval", 5_000, seed=3)
    assert not {d.text for d in train} & {d.text for d in held_out}
    for domain in SYNTHETIC_DOMAINS:
        chars = sum(len(d.text) for d in train if d.domain == domain)
        assert 5_000 <= chars < 5_000 + 3_000, (domain, chars)
    for line in "".join(d.text for d in train if d.domain == "arithmetic").split():
        left, result = line.split("=")
        assert eval(left) == int(result)  # noqa: S307 - digits and one operator, generated above
    for line in "".join(d.text for d in train if d.domain == "strings").splitlines():
        kind, rest = line.split(": ")
        word, out = rest.split(" > ")
        assert out == (word[::-1] if kind == "reverse" else word)


def test_packed_documents_carry_their_domain_on_every_token():
    documents = [Document("ab" * 50, "x"), Document("cd", "y"), Document("e" * 10, "x")]
    packed = pack_documents(documents, ByteTokenizer(), seq_len=64)
    rows, labels = packed.packed.rows, packed.packed.labels
    assert packed.domains == ("x", "y")
    assert np.array_equal(labels >= 0, rows.segment_ids > 0)  # labelled exactly where there are tokens
    for row, row_labels in zip(rows.tokens, labels, strict=True):
        for token, label in zip(row, row_labels, strict=True):
            if label >= 0 and token < 256:
                assert label == (1 if chr(token) in "cd" else 0)
    assert int(np.sum(rows.segment_ids > 0)) == 101 + 3 + 11  # text and an end-of-text per document
    with pytest.raises(ValueError, match="domain 'z'"):
        pack_documents([Document("a", "z")], ByteTokenizer(), 8, domains=("x",))


def test_local_documents_and_their_errors(tmp_path):
    (tmp_path / "notes.txt").write_text("hello world\n")
    (tmp_path / "mix.jsonl").write_text('{"text": "one", "domain": "code"}\n\n{"text": "two"}\n')
    documents = load_documents([tmp_path / "notes.txt", tmp_path / "mix.jsonl"])
    assert documents == [Document("hello world\n", "notes"), Document("one", "code"), Document("two", "mix")]
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"txt": "oops"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected an object with a string \"text\""):
        load_documents([tmp_path / "bad.jsonl"])
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="bad.txt: not valid UTF-8"):
        load_documents([tmp_path / "bad.txt"])
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_documents([tmp_path / "missing.txt"])
    train, held_out = split_documents([Document(str(i), "d") for i in range(40)])
    assert [d.text for d in held_out] == ["19", "39"] and len(train) == 38


def test_overrides_round_trip_and_name_the_bad_field():
    base = presets.get("qwen3-moe-micro")
    overrides = {"moe.router.strategy": "top_k_softmax", "moe.router.top_k": 1, "moe.router.capacity_factor": 2}
    changed = apply_overrides(base, overrides)
    assert (changed.moe.router.strategy, changed.moe.router.top_k, changed.moe.router.capacity_factor) == (
        "top_k_softmax",
        1,
        2.0,
    )
    for path, value in [*overrides.items(), ("attention.qk_norm", "none"), ("moe.router.capacity_factor", None)]:
        assert parse_override(format_override(path, value)) == (path, value)
    with pytest.raises(ValueError, match="RouterConfig has no field 'topk'"):
        apply_overrides(base, {"moe.router.topk": 1})
    with pytest.raises(ValueError, match="norm.ffn_placement='side'"):
        apply_overrides(base, {"norm.ffn_placement": "side"})
    with pytest.raises(ValueError, match="2 with strategy='top2_gating'"):
        apply_overrides(base, {"moe.router.strategy": "top2_gating", "moe.router.top_k": 1})
    with pytest.raises(ValueError, match="FIELD.PATH=VALUE"):
        parse_override("moe.router.top_k")


def _routing(experts: np.ndarray, num_experts: int) -> Routing:
    tokens = experts.shape[0]
    logits = jnp.zeros((tokens, num_experts))
    return Routing(
        weights=jnp.ones(experts.shape),
        experts=jnp.asarray(experts),
        kept=jnp.ones(experts.shape, bool),
        positions=jnp.zeros(experts.shape, jnp.int32),
        logits=logits,
    )


def test_domain_counts_give_mutual_information_one_and_zero():
    rng = np.random.default_rng(0)
    domains = rng.integers(0, 4, size=4096)
    one_hot = jax.nn.one_hot(domains.reshape(1, -1), 4)
    mask = jnp.ones((1, 4096), bool)
    # Perfect one-to-one: domain d always goes to experts 2d and 2d + 1.
    paired = np.stack([2 * domains, 2 * domains + 1], axis=-1)
    stats = router_stats(_routing(paired, 8), mask, 1, one_hot)
    expected = np.zeros((4, 8))
    for d, (a, b) in zip(domains, paired, strict=True):
        expected[d, a] += 1
        expected[d, b] += 1
    np.testing.assert_array_equal(np.asarray(stats.domain_counts), expected)
    assert normalized_mutual_information(expected[:, ::2] + expected[:, 1::2]) == pytest.approx(1.0)
    # Independent of the domain: NMI near 0 (finite-sample bias only).
    independent = np.stack([rng.integers(0, 4, 4096), rng.integers(4, 8, 4096)], axis=-1)
    stats = router_stats(_routing(independent, 8), mask, 1, one_hot)
    assert summarize(jax.tree.map(lambda x: x[None], stats)).domain_nmi[0] < 0.01


def test_model_domain_counts_sum_to_the_layer_assignments():
    config = presets.get("qwen3-moe-micro")
    model = Transformer(config, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 256)
    token_mask = jnp.arange(32)[None, :] < jnp.asarray([[32], [20]])
    domains = jax.nn.one_hot(jax.random.randint(jax.random.key(2), (2, 32), 0, 3), 3)
    aux = model(tokens, token_mask=token_mask).stats(domains)  # from the routing the model returns
    np.testing.assert_allclose(np.asarray(aux.domain_counts).sum(1), np.asarray(aux.expert_counts))
    assert model(tokens).aux.domain_counts is None


def _tiny(out_dir, steps=8, **run):
    return pretrain.Args(
        data=pretrain.DataOptions(seq_len=64, batch_size=4, chars_per_domain=6_000, eval_chars_per_domain=1_500),
        run=pretrain.RunOptions(steps=steps, out_dir=out_dir, checkpoint_every=4, eval_every=4, log_every=2, **run),
        model=pretrain.ModelOptions(override=("moe.router.strategy=sigmoid_top_k", "moe.router.bias_update_rate=0.01")),
    )


def test_pretrain_writes_every_output_and_resumes_exactly(tmp_path):
    straight = pretrain.run(_tiny(tmp_path / "a"))
    for name in ("metrics.jsonl", "metrics.png", "routing.png", "summary.json"):
        assert (tmp_path / "a" / name).is_file(), name
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["overrides"] == {"moe.router.strategy": "sigmoid_top_k", "moe.router.bias_update_rate": 0.01}
    assert summary["domains"] == list(SYNTHETIC_DOMAINS)
    layers = summary["layers"]
    assert len(layers["load_cv"]) == 4 and np.asarray(layers["domain_counts"]).shape == (4, 4, 8)
    assert 0 <= summary["eval_domain_nmi"] <= 1
    evals = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if "eval_loss" in r] == [4, 8]

    pretrain.run(_tiny(tmp_path / "b", steps=4))
    resumed = pretrain.run(_tiny(tmp_path / "b", resume=True))
    assert resumed["final_loss"] == straight["final_loss"] and resumed["eval_loss"] == straight["eval_loss"]


def test_pretrain_command_line_errors_are_one_line(tmp_path, capsys):
    args = _tiny(tmp_path / "c")
    bad = pretrain.Args(model=pretrain.ModelOptions(override=("moe.router.topk=1",)), data=args.data, run=args.run)
    assert pretrain.main(bad) == 2
    assert "RouterConfig has no field 'topk'" in capsys.readouterr().err
    missing = pretrain.Args(data=pretrain.DataOptions(data=(tmp_path / "none.txt",)), run=args.run)
    assert pretrain.main(missing) == 2
    assert "none.txt: data file not found" in capsys.readouterr().err
