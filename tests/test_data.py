"""eqmoe.data: tokenizers, the ChatML loss mask, JSONL errors, built-in tasks, packing and the loader."""

import ast
import re
from pathlib import Path

import numpy as np
import pytest

from eqmoe.data import (
    ALL_KINDS,
    KINDS,
    TRAIN_MIX,
    ByteTokenizer,
    HFTokenizer,
    PackedDataset,
    PackedRows,
    Tokenizer,
    distinct_kinds,
    encode_chat,
    load_conversations,
    load_tokenizer,
    make_example,
    pack,
    pack_conversations,
    prompt_ids,
    render,
    split_of,
    synthetic_split,
    target_mask,
)

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Reverse: abc"},
    {"role": "assistant", "content": "cba"},
]


def test_data_package_does_not_import_the_model():
    for file in (Path(__file__).parents[1] / "eqmoe" / "data").glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                inside = name == "eqmoe.data" or name.startswith("eqmoe.data.")
                leaf = name in ("eqmoe.cache", "eqmoe.progress")  # utilities that import nothing of eqmoe
                assert inside or leaf or not name.startswith("eqmoe"), f"{file.name} imports {name}"


# Tokenizers


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer) and tok.vocab_size == 260
    text = "héllo wörld 世界 🙂 <|im_end|>"
    ids = tok.encode(text)
    assert ids == list(text[:-10].encode("utf-8")) + [259]  # a special spelled out is that special, as in HF
    ((_, offsets),) = tok.encode_with_offsets([text])
    assert [text[a:b] for a, b in offsets[:3]] == ["h", "é", "é"]  # both bytes of é span it
    assert tok.decode(ids) == text
    assert tok.decode(np.asarray(ids, np.int32)) == text
    specials = [tok.pad_id, tok.eos_id, tok.im_start_id, tok.im_end_id]
    assert specials == [256, 257, 258, 259] and tok.bos_id == tok.eos_id
    assert tok.decode([tok.im_start_id, *tok.encode("é"), tok.im_end_id]) == "<|im_start|>é<|im_end|>"
    with pytest.raises(ValueError, match="id 260"):
        tok.decode([260])
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def _save_hf_tokenizer(path: Path, specials: list[str]) -> Path:
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models

    chars = sorted(set("".join(m["content"] + m["role"] for m in CHAT) + "\n"))
    hf = HF(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    hf.decoder = decoders.Fuse()
    hf.add_special_tokens(specials)
    hf.save(str(path))
    return path


def test_hf_tokenizer_encodes_a_chat(tmp_path):
    path = _save_hf_tokenizer(tmp_path / "tokenizer.json", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = HFTokenizer.from_file(path)
    assert isinstance(tok, Tokenizer) and isinstance(load_tokenizer(str(tmp_path)), HFTokenizer)
    base = len(set("".join(m["content"] + m["role"] for m in CHAT) + "\n"))
    assert (tok.eos_id, tok.im_start_id, tok.im_end_id, tok.vocab_size) == (base, base + 1, base + 2, base + 3)
    assert tok.pad_id == tok.eos_id  # no <|pad|>: Qwen pads with <|endoftext|>
    ids, mask = encode_chat(CHAT, tok)
    assert tok.decode(ids) == render(CHAT, tok)
    assert tok.decode(ids[mask]) == "4<|im_end|>cba<|im_end|>"
    assert (ids == tok.im_start_id).sum() == len(CHAT) and (ids == tok.im_end_id).sum() == len(CHAT)


def test_hf_tokenizer_errors_name_the_file(tmp_path):
    path = _save_hf_tokenizer(tmp_path / "tokenizer.json", ["<|endoftext|>", "<|im_start|>"])
    with pytest.raises(ValueError, match=re.escape(str(path)) + r".*no chat template .*<\|im_end\|>") as info:
        HFTokenizer.from_file(path)
    assert "<|im_start|>" not in str(info.value)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json: not a valid"):
        load_tokenizer(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match=r"missing\.json: tokenizer file not found"):
        load_tokenizer(str(tmp_path / "missing.json"))


# Chat template


def test_loss_mask_covers_exactly_assistant_content_and_im_end():
    tok = ByteTokenizer()
    ids, mask = encode_chat(CHAT, tok)
    assert ids.dtype == np.int32 and mask.dtype == bool and ids.shape == mask.shape
    assert tok.decode(ids) == render(CHAT, tok)
    # Each run of true positions is one assistant reply followed by <|im_end|>, in order.
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    runs = [tok.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2], strict=True)]
    assert runs == [m["content"] + "<|im_end|>" for m in CHAT if m["role"] == "assistant"]
    assert not mask[ids == tok.im_start_id].any() and mask[ids == tok.im_end_id].sum() == 2


def test_prompt_ids_is_the_prefix_the_reply_is_trained_after():
    tok = ByteTokenizer()
    prompt = prompt_ids(CHAT[:-1], tok)
    assert tok.decode(prompt) == render(CHAT[:-1], tok, add_generation_prompt=True)
    assert tok.decode(prompt).endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids, mask = encode_chat(CHAT, tok)
    np.testing.assert_array_equal(ids[: len(prompt)], prompt)
    assert mask[len(prompt)] and not mask[len(prompt) - 1]
    with pytest.raises(ValueError, match="last message is the assistant"):
        prompt_ids(CHAT, tok)


@pytest.mark.parametrize(
    "messages, error",
    [
        ([], "empty"),
        ([{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}], r"messages\[1\]\.role='bot'"),
        ([{"role": "user"}], r"messages\[0\]: missing 'content'"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content: must be a string or a list of text parts"),
    ],
)
def test_invalid_messages_are_named(messages, error):
    with pytest.raises(ValueError, match=error):
        encode_chat(messages, ByteTokenizer())


# Conversation files (the file formats themselves: tests/test_records.py)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_conversation_file_loads_skips_blank_lines_and_counts_no_assistant(tmp_path):
    path = _write(
        tmp_path / "chat.jsonl",
        [
            '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}',
            "",
            '{"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "no reply"}]}',
            '{"messages": [{"role": "user", "content": "été"}, {"role": "assistant", "content": "ok", "w": null}]}',
        ],
    )
    data = load_conversations(path)
    assert data.skipped_no_assistant == 1 and data.layout == "messages"
    assert [c.messages for c in data.conversations] == [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        [{"role": "user", "content": "été"}, {"role": "assistant", "content": "ok"}],  # null is no key
    ]


GOOD = '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}'


@pytest.mark.parametrize(
    "line, error",
    [
        ('{"messages": [', "malformed JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"text": "hi"}', "missing 'messages' \\(the file's layout is messages\\)"),
        ('{"messages": "hi"}', "messages: expected a list of messages"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', r"messages\[0\]\.role='bot' is invalid"),
        ('{"messages": [{"role": "user", "content": null}]}', r"messages\[0\]: missing 'content'"),
    ],
)
def test_conversation_errors_name_file_and_line(tmp_path, line, error):
    path = _write(tmp_path / "data.jsonl", [GOOD, "", line])
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: ") + ".*" + error):
        load_conversations(path)


def test_invalid_utf8_empty_and_missing_files(tmp_path):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + b'{"messages": "\xff"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: not valid UTF-8")):
        load_conversations(path)
    empty = _write(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match=re.escape(f"{empty}: no")):
        load_conversations(empty)
    only_users = _write(tmp_path / "users.jsonl", ['{"messages": [{"role": "user", "content": "a"}]}'])
    with pytest.raises(ValueError, match=re.escape(f"{only_users}: no conversation") + r".*1 without"):
        load_conversations(only_users)
    with pytest.raises(ValueError, match="nothing.jsonl: not found"):
        load_conversations(tmp_path / "nothing.jsonl")
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + GOOD.encode() + b"\n")
    assert len(load_conversations(bom).conversations) == 1


# Built-in tasks


def _expected_answer(task: str, prompt: str) -> str:
    """Each kind's answer recomputed from the prompt text alone."""
    if task == "add":
        a, b = re.fullmatch(r"What is (\d{2})\+(\d{2})\?", prompt).groups()
        return str(int(a) + int(b))
    if task == "reverse":
        (word,) = re.fullmatch(r"Reverse: ([a-z]{3,6})", prompt).groups()
        return "".join(reversed(word))
    if task == "sort":
        (digits,) = re.fullmatch(r"Sort: ((?:\d )+\d)", prompt).groups()
        assert 3 <= len(digits.split()) <= 5
        return " ".join(sorted(digits.split(), key=int))
    if task == "max":
        (digits,) = re.fullmatch(r"Largest: ((?:\d )+\d)", prompt).groups()
        assert 3 <= len(digits.split()) <= 6
        return str(max(int(d) for d in digits.split()))
    letter, word = re.fullmatch(r"How many ([a-z]) in ([a-z]{3,7})\?", prompt).groups()
    return str(sum(ch == letter for ch in word))


def test_synthetic_tasks_are_deterministic_disjoint_and_correct():
    train, evaluation = synthetic_split("train", 2000, seed=0), synthetic_split("eval", 400, seed=0)
    assert train == synthetic_split("train", 2000, seed=0) and len(train) == 2000 and len(evaluation) == 400
    assert train[:100] != synthetic_split("train", 100, seed=1)
    assert not {e.prompt for e in train} & {e.prompt for e in evaluation}
    assert not {e.prompt for e in synthetic_split("train", 500, seed=7)} & {e.prompt for e in evaluation}
    assert make_example(3, 11) == make_example(3, 11)
    for split, examples in (("train", train), ("eval", evaluation)):
        assert {e.task for e in examples} == {"add", "reverse", "sort", "max"}
        for e in examples:
            assert split_of(e.prompt) == split
            assert [m["role"] for m in e.messages] == ["user", "assistant"]
            assert e.answer == _expected_answer(e.task, e.prompt), e
    counting = synthetic_split("train", 500, seed=0, kinds=ALL_KINDS)
    assert {e.task for e in counting} == set(ALL_KINDS)
    for e in counting:
        assert e.answer == _expected_answer(e.task, e.prompt), e
    counts = {answer: sum(e.answer == answer for e in counting if e.task == "count") for answer in "0123"}
    assert min(counts.values()) > 10  # the counting task is not all zeros and ones
    lengths = [len(encode_chat(e.messages, ByteTokenizer())[0]) for e in train]
    assert min(lengths) >= 30 and max(lengths) <= 48


def test_training_mix_repeats_a_kind_and_its_held_out_cycle_lists_each_once():
    assert distinct_kinds(TRAIN_MIX) == KINDS and TRAIN_MIX.count("add") == 2
    drawn = [e.task for e in synthetic_split("train", 1000, seed=0, kinds=TRAIN_MIX)]
    assert 0.35 < drawn.count("add") / len(drawn) < 0.45


def test_split_stream_holds_out_about_a_tenth():
    held_out = [split_of(make_example(0, i).prompt) == "eval" for i in range(4000)]
    assert 0.07 < np.mean(held_out) < 0.13


# Packing


def _fake_conversations(count: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Conversations of 1..20 tokens whose ids (1000 * index + position) identify them."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        n = int(rng.integers(1, 21))
        out.append((1000 * i + np.arange(n, dtype=np.int32), rng.random(n) < 0.5))
    return out


def test_pack_first_fit_in_order():
    docs = [(np.full(n, n, np.int32), np.ones(n, bool)) for n in (5, 4, 3, 2)]
    packed = pack(docs, seq_len=8, pad_id=-1)
    rows = packed.rows
    np.testing.assert_array_equal(rows.tokens, [[5] * 5 + [3] * 3, [4] * 4 + [2] * 2 + [-1] * 2])
    np.testing.assert_array_equal(rows.segment_ids, [[1] * 5 + [2] * 3, [1] * 4 + [2] * 2 + [0] * 2])
    np.testing.assert_array_equal(rows.positions, [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 0, 0]])
    assert (packed.num_conversations, packed.too_long, packed.fill) == (4, 0, 14 / 16)


def test_pack_keeps_every_conversation_whole_once_and_in_order():
    docs = _fake_conversations(60)
    packed = pack(docs, seq_len=24, pad_id=7)
    rows = packed.rows
    assert rows.tokens.shape[1] == 24 and all(a.dtype == np.int32 for a in rows[:3]) and rows.loss_mask.dtype == bool
    found = {}
    for r in range(rows.tokens.shape[0]):
        seg = rows.segment_ids[r]
        used = int((seg > 0).sum())
        assert (seg[:used] > 0).all() and (seg[used:] == 0).all() and (rows.tokens[r, used:] == 7).all()
        assert (np.diff(seg[:used]) >= 0).all() and seg[0] == 1 and (np.diff(seg[:used]) <= 1).all()
        previous = -1
        for s in range(1, seg.max() + 1):
            where = np.flatnonzero(seg == s)
            np.testing.assert_array_equal(rows.positions[r, where], np.arange(len(where)))
            index = int(rows.tokens[r, where[0]]) // 1000
            assert index > previous and index not in found  # in order within a row, once overall
            previous = index
            found[index] = (rows.tokens[r, where], rows.loss_mask[r, where])
    assert sorted(found) == list(range(60)) and packed.num_conversations == 60
    for i, (ids, mask) in enumerate(docs):
        np.testing.assert_array_equal(found[i][0], ids)
        np.testing.assert_array_equal(found[i][1], mask)


def test_pack_too_long_is_skipped_or_truncated_and_counted():
    docs = [(np.arange(n, dtype=np.int32), np.ones(n, bool)) for n in (3, 9, 4)]
    skipped = pack(docs, seq_len=8, pad_id=0)
    assert (skipped.num_conversations, skipped.too_long, skipped.rows.tokens.shape) == (2, 1, (1, 8))
    cut = pack(docs, seq_len=8, pad_id=0, overflow="truncate")
    assert (cut.num_conversations, cut.too_long) == (3, 1)
    np.testing.assert_array_equal(cut.rows.tokens[1], np.arange(8))
    with pytest.raises(ValueError, match="all 1 are longer than seq_len=8"):
        pack(docs[1:2], seq_len=8, pad_id=0)


def test_target_mask_never_crosses_documents():
    # Every token is marked for the loss, so only the segment rule can clear a position.
    docs = [(ids, np.ones_like(mask)) for ids, mask in _fake_conversations(40, seed=1)]
    rows = pack(docs, seq_len=32, pad_id=0).rows
    target = target_mask(rows)
    starts = rows.positions == 0
    assert not target[:, 0].any() and not target[starts].any() and not target[rows.segment_ids == 0].any()
    np.testing.assert_array_equal(target, (rows.segment_ids > 0) & ~starts)


def test_pack_conversations_with_chat_data():
    tok = ByteTokenizer()
    examples = synthetic_split("train", 50, seed=0)
    packed = pack_conversations([e.messages for e in examples], tok, seq_len=128)
    assert packed.num_conversations == 50 and packed.fill > 0.8
    rows = packed.rows
    assert (rows.tokens[rows.segment_ids == 0] == tok.pad_id).all()
    answers = tok.decode(rows.tokens[target_mask(rows)])
    assert answers == "".join(e.answer + "<|im_end|>" for e in examples)
    with pytest.raises(ValueError, match=r"conversations\[1\]: messages\[0\]\.role='bot'"):
        pack_conversations([CHAT, [{"role": "bot", "content": "x"}]], tok, seq_len=64)


# Loader


def _dataset(num_rows: int = 10, seq: int = 6) -> PackedDataset:
    tokens = np.arange(num_rows * seq, dtype=np.int32).reshape(num_rows, seq)
    ones = np.ones_like(tokens)
    return PackedDataset(PackedRows(tokens, ones, np.zeros_like(tokens), ones.astype(bool)))


def test_loader_is_deterministic_and_seekable():
    first, second = _dataset(), _dataset()
    late = [second.batch_at(k, 4, seed=3) for k in (9, 2, 5)]  # visited out of order
    for k, batch in zip((9, 2, 5), late, strict=True):
        expected = first.batch_at(k, 4, seed=3)
        for a, b in zip(expected, batch, strict=True):
            np.testing.assert_array_equal(a, b)
    orders = {tuple(first.indices_at(0, 10, seed)) for seed in range(5)}
    assert len(orders) == 5
    assert first.batch_at(0, 4).tokens.shape == (4, 6) and first.epoch(5, 4) == 2.0


def test_loader_visits_every_row_once_per_epoch():
    dataset = _dataset(num_rows=10)
    stream = np.concatenate([dataset.indices_at(k, 4, seed=1) for k in range(15)])  # 60 items: 6 epochs
    epochs = stream.reshape(6, 10)
    for epoch in epochs:
        assert sorted(epoch) == list(range(10))
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled per epoch
    rows = dataset.batch_at(2, 4, seed=1).tokens[:, 0] // 6
    np.testing.assert_array_equal(rows, stream[8:12])


def test_loader_shards_split_the_global_batch():
    dataset = _dataset()
    whole = dataset.batch_at(7, 6, seed=2)
    parts = [dataset.batch_at(7, 6, seed=2, shard=(i, 3)) for i in range(3)]
    assert parts[0].tokens.shape == (2, 6)
    np.testing.assert_array_equal(np.concatenate([p.tokens for p in parts]), whole.tokens)
    with pytest.raises(ValueError, match="multiple of process_count=4"):
        dataset.batch_at(0, 6, shard=(0, 4))
    with pytest.raises(ValueError, match="shard=.*invalid"):
        dataset.batch_at(0, 6, shard=(3, 3))
    with pytest.raises(ValueError, match="step=-1"):
        dataset.batch_at(-1, 6)
