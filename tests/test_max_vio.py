"""MaxVio (Wang et al. 2024) and the micro-batch load-balance loss (Qiu et al. 2025), each against a NumPy
re-derivation from its definition on synthetic routings, then MaxVio in a training run's metrics.jsonl and
TensorBoard events, in its held-out evaluation and in analyze_routing's output."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe import presets
from eqmoe.analysis.routing import accumulate, max_violation, summarize
from eqmoe.checkpoints.model_checkpoint import save_model
from eqmoe.config import LossConfig
from eqmoe.model import Transformer
from eqmoe.nn.router import Routing
from eqmoe.nn.routing_stats import layer_stats, pooled_load_balance
from eqmoe.nn.routing_stats import max_violation as jax_max_violation
from eqmoe.registries import LOAD_BALANCE
from eqmoe.train.step import Batch, accumulated_loss_and_grads
from experiments import analyze_routing, pretrain
from tests.test_pretrain import _tiny

NUM_EXPERTS, TOP_K, ROWS, SEQ = 6, 2, 4, 8


def _synthetic_routing(seed: int) -> tuple[Routing, np.ndarray, np.ndarray]:
    """Three MoE layers of random distinct top-2 choices over 6 experts (layer 1 skewed toward expert 0), random
    logits, and a token mask with padding: row 1 ends early and row 3 is all padding. The padding tokens all choose
    expert 5, so counting them would show. Returns the stacked routing, ``experts [layers, tokens, k]`` and the mask."""
    rng = np.random.default_rng(seed)
    tokens = ROWS * SEQ
    experts = np.stack([rng.permutation(NUM_EXPERTS)[:TOP_K] for _ in range(3 * tokens)]).reshape(3, tokens, TOP_K)
    skewed = rng.random(tokens) < 0.7
    experts[1, skewed, 0] = 0
    experts[1, skewed, 1] = rng.integers(1, NUM_EXPERTS, skewed.sum())
    mask = np.ones((ROWS, SEQ), bool)
    mask[1, 5:] = False
    mask[3] = False
    experts[:, ~mask.reshape(-1)] = [NUM_EXPERTS - 1, NUM_EXPERTS - 2]
    logits = rng.normal(size=(3, tokens, NUM_EXPERTS)).astype(np.float32)
    routing = Routing(
        weights=jnp.ones(experts.shape),
        experts=jnp.asarray(experts),
        kept=jnp.ones(experts.shape, bool),
        positions=jnp.zeros(experts.shape, jnp.int32),
        logits=jnp.asarray(logits),
    )
    return routing, experts, mask


def _max_vio_by_definition(experts: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Per layer: load_e = number of top-k assignments of real tokens to e; max_e load_e / mean_e load_e - 1."""
    result = []
    for layer in experts:
        load = [0] * NUM_EXPERTS
        for token, choices in enumerate(layer):
            if mask.reshape(-1)[token]:
                for expert in choices:
                    load[expert] += 1
        mean = sum(load) / NUM_EXPERTS
        result.append(max(load) / mean - 1 if mean else 0.0)
    return np.asarray(result)


def test_max_vio_equals_its_definition_on_synthetic_routings():
    routing, experts, mask = _synthetic_routing(0)
    stats = layer_stats(routing, jnp.asarray(mask))
    expected = _max_vio_by_definition(experts, mask)
    assert expected[1] > max(expected[0], expected[2]) + 0.5  # the skewed layer stands out
    np.testing.assert_allclose(stats.max_vio, expected, rtol=1e-6)
    np.testing.assert_allclose(summarize(jax.tree.map(np.asarray, stats)).max_vio, expected, rtol=1e-12)

    # perfectly balanced: 0; no real token: 0, not NaN; one expert takes everything: E - 1
    counts = np.array([[5.0] * NUM_EXPERTS, [0.0] * NUM_EXPERTS, [12.0] + [0.0] * (NUM_EXPERTS - 1)])
    np.testing.assert_allclose(max_violation(counts), [0.0, 0.0, NUM_EXPERTS - 1], atol=1e-12)
    np.testing.assert_allclose(jax_max_violation(jnp.asarray(counts)), [0.0, 0.0, NUM_EXPERTS - 1], atol=1e-6)

    # over several batches MaxVio is that of the summed loads, not the mean of the batches'
    other_routing, other_experts, other_mask = _synthetic_routing(1)
    total = accumulate(accumulate(None, stats), layer_stats(other_routing, jnp.asarray(other_mask)))
    both = np.concatenate([experts, other_experts], axis=1)
    np.testing.assert_allclose(
        summarize(total).max_vio, _max_vio_by_definition(both, np.concatenate([mask, other_mask])), rtol=1e-12
    )


def test_accumulated_micro_batches_log_the_whole_step_routing_figures():
    """Under gradient accumulation MaxVio, the dropped fraction and router entropy are those of the step's summed
    routing sums (assignments, drops, entropy over real tokens), not means of the micro-batches' ratios."""
    rng = np.random.default_rng(2)
    counts_of_row = jnp.asarray(rng.integers(0, 9, (4, 2, NUM_EXPERTS)), jnp.float32)
    dropped_of_row = jnp.asarray(rng.integers(0, 5, (4, 2)), jnp.float32)
    tokens_of_row = jnp.asarray(rng.integers(1, 30, (4, 2)), jnp.float32)
    entropy_of_row = tokens_of_row * jnp.asarray(rng.uniform(0.5, 2.0, (4, 2)), jnp.float32)

    def loss_of(params, rows, key):  # rows.tokens[:, 0] names each row's routing sums
        row = rows.tokens[:, 0]
        sums = {
            "expert_counts": counts_of_row[row].sum(0),
            "dropped": dropped_of_row[row].sum(0),
            "entropy_sum": entropy_of_row[row].sum(0),
            "num_tokens": tokens_of_row[row].sum(0),
        }
        terms = {"loss": params * 0.0, "target_tokens": jnp.sum(rows.target_mask[:, 1:]).astype(jnp.float32)}
        return params * 0.0, (terms, sums)

    index = jnp.arange(4)[:, None] * jnp.ones((1, 3), jnp.int32)
    batch = Batch(index, jnp.ones_like(index), index * 0, jnp.ones(index.shape, bool))
    terms, sums, _ = accumulated_loss_and_grads(loss_of, jnp.float32(1.0), batch, 2, jax.random.key(0))
    whole = np.asarray(counts_of_row).sum(0)
    np.testing.assert_allclose(sums["expert_counts"], whole)
    np.testing.assert_allclose(terms["max_vio_by_layer"], max_violation(whole), rtol=1e-6)
    np.testing.assert_allclose(terms["max_vio"], max_violation(whole).mean(), rtol=1e-6)
    dropped = np.asarray(dropped_of_row).sum(0) / whole.sum(-1)
    np.testing.assert_allclose(terms["dropped_fraction_by_layer"], dropped, rtol=1e-6)
    entropy = np.asarray(entropy_of_row).sum(0) / np.asarray(tokens_of_row).sum(0) / np.log(NUM_EXPERTS)
    np.testing.assert_allclose(terms["router_entropy_by_layer"], entropy, rtol=1e-6)
    np.testing.assert_allclose(terms["router_entropy"], entropy.mean(), rtol=1e-6)
    halves = [np.asarray(counts_of_row)[[j, j + 2]].sum(0) for j in range(2)]  # micro-batch j: rows j, j + 2
    assert not np.allclose(terms["max_vio_by_layer"], np.mean([max_violation(h) for h in halves], axis=0))
    half_drops = [np.asarray(dropped_of_row)[[j, j + 2]].sum(0) / halves[j].sum(-1) for j in range(2)]
    assert not np.allclose(terms["dropped_fraction_by_layer"], np.mean(half_drops, axis=0))


def _hf_balance_by_definition(experts: np.ndarray, probs: np.ndarray, real: np.ndarray) -> float:
    """HF ``load_balancing_loss_func`` over the real tokens of every layer pooled: E * sum_e f_e P_e with f_e the
    fraction of tokens whose top-k holds e and P_e the mean router probability of e."""
    chosen = np.concatenate([layer[real] for layer in experts])
    mean_probs = np.concatenate([layer[real] for layer in probs]).mean(0)
    fractions = np.asarray([(chosen == e).any(-1).mean() for e in range(NUM_EXPERTS)])
    return NUM_EXPERTS * float(np.sum(fractions * mean_probs))


def _micro_batch_balance_by_definition(experts, probs, mask, rows_per_slice, layers) -> float:
    """The mean over slices of consecutive rows (those with a real token) of each slice's HF balance."""
    experts, probs = experts[layers], probs[layers]
    values = []
    for start in range(0, ROWS, rows_per_slice):
        real = np.zeros((ROWS, SEQ), bool)
        real[start : start + rows_per_slice] = mask[start : start + rows_per_slice]
        if real.any():
            values.append(_hf_balance_by_definition(experts, probs, real.reshape(-1)))
    return float(np.mean(values))


@pytest.mark.parametrize("layers", [[0], [0, 1, 2]], ids=["one_layer", "three_layers"])
def test_micro_batch_balance_is_the_mean_of_the_slices_hf_balances(layers):
    routing, experts, mask = _synthetic_routing(3)
    routing = jax.tree.map(lambda x: x[np.asarray(layers)], routing)
    probs = np.asarray(jax.nn.softmax(routing.logits, axis=-1))
    micro_batch = LOAD_BALANCE.get("micro_batch")
    for rows_per_slice in (1, 2, 3, ROWS):  # 3: the last slice is one row; row 3 (all padding) never counts
        stats = layer_stats(routing, jnp.asarray(mask), balance_micro_batch_rows=rows_per_slice)
        expected = _micro_batch_balance_by_definition(experts, probs, mask, rows_per_slice, layers)
        np.testing.assert_allclose(micro_batch(stats), expected, rtol=1e-5, err_msg=f"{rows_per_slice} rows")
        np.testing.assert_allclose(stats.expert_counts, layer_stats(routing, jnp.asarray(mask)).expert_counts)
    whole = layer_stats(routing, jnp.asarray(mask), balance_micro_batch_rows=ROWS)
    np.testing.assert_allclose(micro_batch(whole), pooled_load_balance(whole), rtol=1e-6)
    per_row = layer_stats(routing, jnp.asarray(mask), balance_micro_batch_rows=1)
    assert abs(float(micro_batch(per_row)) - float(pooled_load_balance(per_row))) > 1e-3


def test_balance_micro_batch_rows_is_checked():
    for bad in (0, -2):
        with pytest.raises(ValueError, match=r"LossConfig.balance_micro_batch_rows=.* is invalid; allowed: an integer"):
            LossConfig(balance_micro_batch_rows=bad)
    assert LossConfig(load_balance="micro_batch", balance_micro_batch_rows=3).balance_micro_batch_rows == 3


def _scalars(out_dir) -> dict[str, list[tuple[int, float]]]:
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = event_accumulator.EventAccumulator(str(out_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_training_run_logs_max_vio_and_trains_the_micro_batch_balance(tmp_path):
    out = tmp_path / "run"
    args = _tiny(out, steps=4, tracker=("jsonl", "tensorboard"))
    balance = ("loss.load_balance=micro_batch", "loss.balance_micro_batch_rows=2")
    model = dataclasses.replace(args.model, override=args.model.override + balance)
    summary = pretrain.run(dataclasses.replace(args, model=model))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert train and all(len(r["max_vio_by_layer"]) == 4 for r in train)
    for r in train:
        assert r["max_vio"] == pytest.approx(np.mean(r["max_vio_by_layer"]), rel=1e-5)
        assert 0 <= r["max_vio"] <= 7  # at most E - 1
        assert r["load_balance"] == r["load_balance_micro_batch"] != r["load_balance_hf_pooled"]
    evals = [r for r in records if "eval_loss" in r]
    assert evals and all(0 <= r["eval_max_vio"] <= 7 for r in evals)
    layers = summary["layers"]
    assert summary["eval_max_vio"] == pytest.approx(np.mean(layers["max_vio"]))
    shares = np.asarray(layers["load"])
    np.testing.assert_allclose(layers["max_vio"], shares.max(-1) / shares.mean(-1) - 1, rtol=1e-9)

    scalars = _scalars(out)
    assert [value for _, value in scalars["max_vio"]] == pytest.approx([r["max_vio"] for r in train], rel=1e-6)
    for layer in range(4):
        logged = scalars[f"max_vio_by_layer/layer_{layer:02d}"]
        assert [step for step, _ in logged] == [r["step"] for r in train]
        assert [v for _, v in logged] == pytest.approx([r["max_vio_by_layer"][layer] for r in train], rel=1e-6)
    assert "eval_max_vio" in scalars


def test_analyze_routing_reports_max_vio(tmp_path, capsys):
    config = presets.get("qwen3-moe-micro").replace(layers=("dense", "moe") * 2)  # MoE layers 1 and 3
    checkpoint = save_model(Transformer(config, key=jax.random.key(0)), tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"{a} plus {a} is {2 * a}\n" * 3}) for a in range(12)))
    out = tmp_path / "out"
    args = analyze_routing.Args(
        checkpoint=checkpoint, data=(data,), tokens=200, batch_size=4, seq_len=64, out_dir=out, trace="jsonl"
    )
    assert analyze_routing.main(args) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "routing.json").read_text())

    loads = {1: [0] * 8, 3: [0] * 8}  # from the trace: every real token's top-k experts per MoE layer
    for line in (out / "trace.jsonl").read_text().splitlines():
        row = json.loads(line)
        for expert in row["experts"]:
            loads[row["layer"]][expert] += 1
    expected = [max(load) / (sum(load) / 8) - 1 for load in loads.values()]
    np.testing.assert_allclose(summary["load"]["max_vio"], expected, rtol=1e-5)

    lines = printed.splitlines()
    header = next(line for line in lines if line.startswith("layer"))
    start = header.index("MaxVio")
    table = [line for line in lines if line[:5].strip() in ("1", "3")]
    assert [float(line[start : start + 6]) for line in table] == pytest.approx(expected, abs=1e-3)
