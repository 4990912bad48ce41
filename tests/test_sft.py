"""SFT end to end: exact resume, packing, fine-tuning a converted HF model, and bad input."""

import dataclasses
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqmoe import Transformer, presets
from eqmoe.checkpoints.orbax import Checkpointer
from eqmoe.data import ByteTokenizer, encode_chat, pack, synthetic_split
from experiments import sft
from tests.conftest import save_tiny_hf

FAST = dict(seq_len=64, batch_size=4, train_examples=300, eval_examples=12)


def _args(out_dir, steps, **changes) -> sft.Args:
    run = sft.RunOptions(steps=steps, out_dir=out_dir, checkpoint_every=10, eval_every=1000, log_every=5, samples=0)
    args = sft.Args(
        model=sft.ModelOptions(preset="qwen3-moe-micro"),
        data=sft.DataOptions(**FAST),
        # a rate and a cosine fixed in steps: a run extended by --resume keeps one long run's schedule
        optim=dataclasses.replace(sft.Args().optim, learning_rate=3e-3, warmup_steps=5, decay_steps=2000),
        run=run,
    )
    for group, values in changes.items():
        args = dataclasses.replace(args, **{group: dataclasses.replace(getattr(args, group), **values)})
    return args


def _restore_leaves(out_dir, config):
    from eqmoe.train.optimizer import make_optimizer
    from eqmoe.train.state import abstract_state

    model = Transformer(config, key=jax.random.key(0))
    optim = sft.Args().optim.for_run(30, 3e-3)  # the optimizer's state has the same shapes whatever the rate
    optimizer, _ = make_optimizer(optim, eqx.filter(model, eqx.is_array), embed_dim=config.embed_dim)
    with Checkpointer(out_dir / "checkpoints") as checkpointer:
        state, metadata = checkpointer.restore(None, abstract_state(lambda: model, optimizer, key=jax.random.key(1)))
    state = eqx.tree_at(lambda s: s.key, state, jax.random.key_data(state.key))
    return jax.tree.leaves(eqx.filter(state, eqx.is_array)), metadata


# Every leaf bit for bit after a resume: tests/test_reliability.py (the same loop, killed and resumed) and
# tests/test_run_folder.py (sft resumed to the same loss) cover it by default.
@pytest.mark.slow
def test_resume_is_bit_identical(tmp_path):
    straight = sft.run(_args(tmp_path / "a", 30))
    sft.run(_args(tmp_path / "b", 15))
    resumed = sft.run(_args(tmp_path / "b", 30, run={"resume": True}))
    assert resumed["final_loss"] == straight["final_loss"]
    config = presets.get("qwen3-moe-micro")
    leaves_a, meta_a = _restore_leaves(tmp_path / "a", config)
    leaves_b, meta_b = _restore_leaves(tmp_path / "b", config)
    assert meta_a["step"] == meta_b["step"] == 30 and meta_a["data_step"] == 30
    for a, b in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(a, b)
    records = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [5, 10, 15, 20, 25, 30]
    for name in ("metrics.png", "summary.json"):
        assert (tmp_path / "b" / name).is_file()


def test_built_in_task_mix_and_held_out_accuracy_by_task(tmp_path):
    args = _args(tmp_path, 5, data={"tasks": ("add", "sort", "add"), "eval_examples": 30})
    data = sft._chat_data(args.data, ByteTokenizer(), seed=0, samples=0)
    train, held_out, tasks = data.train, data.held_out, data.held_out_tasks
    kinds = [e.task for e in synthetic_split("train", len(train), 0, ("add", "sort", "add"))]
    assert 1.7 < kinds.count("add") / kinds.count("sort") < 2.3  # a kind listed twice is drawn twice as often
    assert tasks == [e.task for e in synthetic_split("eval", 30, 0, ("add", "sort"))]  # held out: each once
    summary = sft.run(args)
    by_task = summary["eval_accuracy_by_task"]
    assert sorted(by_task) == ["add", "sort"] and all(0.0 <= v <= 1.0 for v in by_task.values())
    assert abs(np.mean(list(by_task.values())) - summary["eval_accuracy"]) <= 1 / len(held_out)


def test_packed_row_loss_is_the_sum_of_its_conversations():
    config = presets.get("qwen3-moe-micro")
    model = Transformer(config, key=jax.random.key(3))
    tokenizer = ByteTokenizer()
    encoded = [encode_chat(e.messages, tokenizer) for e in synthetic_split("train", 3, seed=4)]
    row = pack(encoded, 160, tokenizer.pad_id).rows
    assert row.tokens.shape[0] == 1 and row.segment_ids.max() == 3

    def summed_loss(tokens, segment_ids, positions, loss_mask):
        logits = model(
            jnp.asarray(tokens),
            segment_ids=jnp.asarray(segment_ids),
            positions=jnp.asarray(positions),
            token_mask=jnp.asarray(segment_ids) != 0,
        ).logits[0, :-1]
        targets = np.asarray(tokens)[0, 1:]
        keep = np.asarray(loss_mask)[0, 1:] & (np.asarray(segment_ids)[0, 1:] == np.asarray(segment_ids)[0, :-1])
        losses = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[:, None], -1)[:, 0]
        return float(jnp.sum(jnp.where(keep, losses, 0.0)))

    packed = summed_loss(row.tokens, row.segment_ids, row.positions, row.loss_mask)
    separate = sum(
        summed_loss(ids[None], np.ones((1, len(ids)), np.int32), np.arange(len(ids))[None], mask[None])
        for ids, mask in encoded
    )
    np.testing.assert_allclose(packed, separate, rtol=1e-5)


def test_sft_from_a_converted_hf_model_on_jsonl_with_a_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [
        "<unk>",
        "what",
        "is",
        "the",
        "colour",
        "of",
        "sky",
        "grass",
        "blue",
        "green",
        "user",
        "assistant",
        "\n",
        "?",
        "snow",
        "white",
    ]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=r"\s|\?|\n", behavior="isolated")
    tokenizer.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    facts = [("sky", "blue"), ("grass", "green"), ("snow", "white")]
    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": f"what is the colour of the {thing}?"},
                    {"role": "assistant", "content": colour},
                ]
            }
        )
        for thing, colour in facts * 10
    ]
    (tmp_path / "chats.jsonl").write_text("\n".join(lines) + "\n")
    save_tiny_hf(tmp_path / "hf", vocab_size=32, num_hidden_layers=2)

    args = _args(
        tmp_path / "run",
        30,
        model={"init_from_hf": tmp_path / "hf"},
        data={"data": tmp_path / "chats.jsonl", "tokenizer": tmp_path / "tokenizer.json"},
    )
    summary = sft.run(args)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["cross_entropy"] for r in records if "cross_entropy" in r]
    assert losses[-1] < 0.5 * losses[0]
    assert summary["config"]["vocab_size"] == 32


def _fails(capsys, args) -> str:
    assert sft.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    return err[-1]


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{oops\n')
    assert f"{bad}:2" in _fails(capsys, _args(tmp_path / "o1", 2, data={"data": bad}))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert str(empty) in _fails(capsys, _args(tmp_path / "o2", 2, data={"data": empty}))
    missing = tmp_path / "nope"
    assert str(missing) in _fails(capsys, _args(tmp_path / "o3", 2, model={"init_from_hf": missing}))
    from tokenizers import Tokenizer, models

    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(600)}, unk_token="w0"))
    big.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    big.save(str(tmp_path / "tokenizer.json"))
    message = _fails(capsys, _args(tmp_path / "o4", 2, data={"tokenizer": tmp_path / "tokenizer.json"}))
    assert "603" in message and "512" in message
    for folder in ("o1", "o2", "o3", "o4"):
        assert not (tmp_path / folder / "summary.json").exists()


def test_no_assistant_turn_is_skipped_and_counted(tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    lines = [json.dumps(good)] * 20 + [json.dumps({"messages": [{"role": "user", "content": "hello"}]})]
    data.write_text("\n".join(lines) + "\n")
    sft.run(_args(tmp_path / "run", 2, data={"data": data}))
    assert "1 skipped (no assistant turn)" in capsys.readouterr().err


def test_nan_loss_stops_with_a_message_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    args = _args(tmp_path / "run", 60, optim={"learning_rate": 1e12, "warmup_steps": 0, "clip_norm": None})
    message = _fails(capsys, args)
    assert "non-finite" in message and "last good checkpoint" in message
    with Checkpointer(tmp_path / "run" / "checkpoints") as checkpointer:
        steps = checkpointer.all_steps()
    assert all(step % 10 == 0 for step in steps)
