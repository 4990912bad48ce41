"""A folder with ``tiktoken.model`` and no ``tokenizer.json`` (the Kimi family: Kimi K2, Moonlight) loads as the
tokenizer its ``tokenization_kimi.py`` builds. The reference here is that published construction, written out
independently of eqmoe: a ``tiktoken.Encoding`` with Kimi's ``pat_str``, the ranks of ``tiktoken.model`` as
``tiktoken.load.load_tiktoken_bpe`` reads them, ``added_tokens_decoder`` as the special tokens with
``<|reserved_token_{i}|>`` in the 256 ids after the ranks that it names none of, and ``encode`` cutting the text
into 400,000-character chunks and runs of more than 25,000 (non-)whitespace characters, special tokens allowed.
"""

import base64
import fnmatch
import json
import re
import shutil

import numpy as np
import pytest

from eqmoe.data import HFTokenizer, encode_chat, end_of_turn_ids, load_tokenizer, render
from eqmoe.data.tokenizer import KIMI_PATTERN, TiktokenTokenizer, tokenizer_file, tokenizer_vocab_size

tiktoken = pytest.importorskip("tiktoken")

# tokenization_kimi.py's TikTokenTokenizer.pat_str (moonshotai/Kimi-K2-Instruct; the same in Moonlight's
# tokenization_moonshot.py).
PUBLISHED_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# A byte-level rank table: the 256 single bytes, then merges each joining two earlier tokens.
MERGES = [
    b"he", b"ll", b"llo", b"hello", b" w", b"or", b"ld", b" wor", b" world", b"ab", b"abc", b"12", b"'s",
    "你".encode()[:2], "你".encode(), "好".encode()[:2], "好".encode(), "你好".encode(),
]  # fmt: skip
# Kimi K2's tokenizer_config.json layout: ids after the ranks, some named, the rest reserved.
NAMED = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    17: "<|im_middle|>",
    254: "[UNK]",
    255: "[PAD]",
}
TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
BASE = 256 + len(MERGES)
TEXTS = [
    "hello world",
    "Hello, World! I'LL say it's John's turn; we've 1234567 apples.",
    "你好世界，你好!  中English文 abc中文def",
    "emoji 🚀🌍 café naïve",
    "  \n\n\t\r\n   x  ",
    "<|im_user|>user<|im_middle|>hi<|im_end|>[BOS]",
    f"a <|reserved_token_{BASE + 20}|> b <|reserved_token_{BASE + 2}|>",  # reserved: the first is one, not the second
    "",
]


def _kimi_folder(folder, *, config_extra=None):
    folder.mkdir(parents=True, exist_ok=True)
    tokens = [bytes([b]) for b in range(256)] + MERGES
    lines = [f"{base64.b64encode(token).decode()} {rank}" for rank, token in enumerate(tokens)]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    added = {
        str(BASE + offset): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for offset, content in NAMED.items()
    }
    config = {
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "chat_template": TEMPLATE,
        "model_max_length": 131072,
        "tokenizer_class": "TikTokenTokenizer",
        **(config_extra or {}),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": BASE + 2}))
    (folder / "tokenization_kimi.py").write_text("# the remote code transformers reads tiktoken.model with\n")
    return folder


@pytest.fixture
def folder(tmp_path):
    return _kimi_folder(tmp_path / "kimi")


def _published_encoding(folder, monkeypatch):
    """``TikTokenTokenizer.__init__`` of tokenization_kimi.py."""
    from tiktoken.load import load_tiktoken_bpe

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # read the file itself, not tiktoken's cache of that path
    mergeable_ranks = load_tiktoken_bpe(str(folder / "tiktoken.model"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    special_tokens_mapping = {int(i): token["content"] for i, token in config["added_tokens_decoder"].items()}
    num_base_tokens = len(mergeable_ranks)
    special_tokens = {
        special_tokens_mapping.get(i, f"<|reserved_token_{i}|>"): i
        for i in range(num_base_tokens, num_base_tokens + 256)
    }
    return tiktoken.Encoding(
        name="tiktoken.model",
        pat_str=PUBLISHED_PAT_STR,
        mergeable_ranks=mergeable_ranks,
        special_tokens=special_tokens,
    )


def _split_whitespaces_or_nonwhitespaces(s, max_consecutive_slice_len):
    """tokenization_kimi.py's cut of long runs, as published."""
    current_slice_len = 0
    current_slice_is_space = s[0].isspace() if len(s) > 0 else False
    slice_start = 0
    for i in range(len(s)):
        is_now_space = s[i].isspace()
        if current_slice_is_space ^ is_now_space:
            current_slice_len = 1
            current_slice_is_space = is_now_space
        else:
            current_slice_len += 1
            if current_slice_len > max_consecutive_slice_len:
                yield s[slice_start:i]
                slice_start = i
                current_slice_len = 1
    yield s[slice_start:]


def _published_encode(encoding, text):
    """``TikTokenTokenizer.encode(text)`` (``allow_special_tokens=True``)."""
    ids = []
    for i in range(0, len(text), 400_000):
        for substr in _split_whitespaces_or_nonwhitespaces(text[i : i + 400_000], 25_000):
            ids.extend(encoding.encode(substr, allowed_special="all"))
    return ids


def test_encode_decode_match_the_published_tokenizer(folder, monkeypatch):
    reference = _published_encoding(folder, monkeypatch)
    tok = load_tokenizer(folder)
    assert isinstance(tok, TiktokenTokenizer) and isinstance(tok, HFTokenizer)
    assert KIMI_PATTERN == PUBLISHED_PAT_STR
    assert tok.path == str(folder / "tiktoken.model") and tokenizer_file(folder) == folder / "tiktoken.model"
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == _published_encode(reference, text), text
        assert tok.decode(ids) == reference.decode(ids) == text
        assert tok.decode(np.asarray(ids, np.int32)) == text
    # The merges are used; the reserved token spelled out is that token, a non-reserved lookalike is text.
    assert tok.encode("hello world") == [256 + MERGES.index(b"hello"), 256 + MERGES.index(b" world")]
    assert BASE + 20 in tok.encode(TEXTS[6]) and BASE + 2 in tok.encode("<|im_end|>")
    # Lone surrogates are U+FFFD, as tiktoken itself encodes them.
    assert tok.encode("a\ud800b") == reference.encode("a\ud800b") == reference.encode("a\ufffdb")
    with pytest.raises(
        ValueError, match=rf"tiktoken\.model: id {BASE + 256} is no token \(ids are 0\.\.{BASE + 255}\)"
    ):
        tok.decode([1, BASE + 256])


def test_long_texts_are_cut_as_published(folder, monkeypatch):
    reference = _published_encoding(folder, monkeypatch)
    tok = load_tokenizer(folder)
    long_run = "xy" + "abc" * 20_000 + " hello" + " " * 30_000 + "x"  # cut inside "abc" and inside the spaces
    chunked = "hello world 你好 " * 26_700  # 400,500 characters: the chunk boundary cuts " worl|d"
    for text in (long_run, chunked):
        ids = tok.encode(text)
        assert ids == _published_encode(reference, text)
        assert ids != reference.encode(text, allowed_special="all")  # the cuts change the ids
        assert tok.decode(ids) == text
        (ids_o, offsets), *_ = tok.encode_with_offsets([text])
        assert ids_o.tolist() == ids and offsets[-1, 1] == len(text)


def test_special_ids_reserved_fill_and_named_tokens(folder, monkeypatch):
    reference = _published_encoding(folder, monkeypatch)
    tok = load_tokenizer(folder)
    assert tok.vocab_size == reference.n_vocab == BASE + 256 == tokenizer_vocab_size(folder / "tiktoken.model")
    assert tok.special_ids == {i: token for token, i in reference._special_tokens.items()}
    for offset, content in NAMED.items():
        assert tok.token_to_id(content) == BASE + offset and tok.special_ids[BASE + offset] == content
    assert tok.special_ids[BASE + 5] == f"<|reserved_token_{BASE + 5}|>"
    assert tok.token_to_id(f"<|reserved_token_{BASE + 255}|>") is None  # [PAD] is named there
    assert tok.token_to_id("hello") == 256 + MERGES.index(b"hello") and tok.token_to_id("h") == ord("h")
    assert tok.token_to_id("<|im_start|>") is None and tok.token_to_id("hellohello") is None
    # No <|endoftext|>: bos and eos are eos_token, pad is pad_token (as for any tokenizer.json folder).
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (BASE + 1, BASE + 1, BASE + 255)
    assert (tok.im_start_id, tok.im_end_id, tok.stop_ids) == (None, BASE + 2, (BASE + 2,))
    assert tok.special_tokens == {
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
    }
    # Plain text (chat=False) reads the same ids and skips special tokens when decoding.
    text = load_tokenizer(folder / "tiktoken.model", chat=False)
    assert text.encode(TEXTS[5]) == tok.encode(TEXTS[5]) and text.decode(tok.encode(TEXTS[5])) == "userhi"
    alone = HFTokenizer.from_file(folder / "tiktoken.model", chat=False)  # no template: plain text
    assert isinstance(alone, TiktokenTokenizer) and alone.special_ids == tok.special_ids


def test_offsets_span_each_tokens_characters(folder):
    tok = load_tokenizer(folder)
    encoded = tok.encode_with_offsets(TEXTS)
    for text, (ids, offsets) in zip(TEXTS, encoded, strict=True):
        assert ids.dtype == np.int32 and offsets.dtype == np.int64 and offsets.shape == (len(ids), 2)
        assert ids.tolist() == tok.encode(text)
        if not len(ids):
            continue
        assert offsets[0, 0] == 0 and offsets[-1, 1] == len(text) and (offsets[1:, 0] >= offsets[:-1, 0]).all()
        for i, (start, end) in zip(ids.tolist(), offsets.tolist(), strict=True):
            piece = tok.decode([i])
            if "\ufffd" not in piece:  # a whole token's characters
                assert text[start:end] == piece, (text, i)
            else:  # part of a character's bytes: it spans that character
                assert end - start == 1 and len(text[start].encode()) > 1
    ids, offsets = tok.encode_with_offsets(["世"])[0]  # three byte tokens of one character
    assert len(ids) == 3 and offsets.tolist() == [[0, 1]] * 3


def test_chat_template_renders_and_masks_the_reply(folder):
    tok = load_tokenizer(folder)
    assert tok.chat_template.origin == str(folder / "tokenizer_config.json")
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "你好 world"},
    ]
    text = render(chat, tok)
    assert text == (
        "<|im_system|>system<|im_middle|>be brief<|im_end|><|im_user|>user<|im_middle|>hello<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>你好 world<|im_end|>"
    )
    ids, mask = encode_chat(chat, tok)
    assert tok.decode(ids) == text and tok.decode(ids[mask]) == "你好 world<|im_end|>"
    assert (ids == tok.im_end_id).sum() == 3 and end_of_turn_ids(tok) == (BASE + 2,)


def test_folder_without_a_tokenizer_is_refused_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError) as info:
        load_tokenizer(tmp_path / "empty")
    assert (
        str(info.value)
        == f"{tmp_path / 'empty'}: no tokenizer in this folder (looked for tokenizer.json and tiktoken.model)"
    )
    bad = _kimi_folder(tmp_path / "bad")
    (bad / "tiktoken.model").write_text("aGVsbG8= 0\nnot-a-line\n")
    with pytest.raises(ValueError) as info:
        load_tokenizer(bad)
    line = "not a tiktoken.model (line 2: expected a base64 token and a rank, found 'not-a-line')"
    assert str(info.value) == f"{bad / 'tiktoken.model'}: {line}"
    (bad / "tiktoken.model").write_text("YQ== 0\nYg== 1\n")
    with pytest.raises(ValueError, match=r"^\S*tiktoken\.model: not a tiktoken\.model \(lacks the single bytes 0x0, "):
        load_tokenizer(bad)
    (bad / "tiktoken.model").write_text("YQ== 0\nYg== 5\n")
    with pytest.raises(ValueError, match=re.escape("the ranks of its 2 tokens are not 0..1")):
        load_tokenizer(bad)


def test_a_tokenizer_json_is_read_before_tiktoken_model(folder):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(folder / "tokenizer.json"))
    tok = load_tokenizer(folder)
    assert type(tok) is HFTokenizer and tok.path == str(folder / "tokenizer.json")


def test_hub_downloads_and_exports_carry_tiktoken_model(folder, tmp_path):
    from eqmoe.checkpoints.export_files import export_files
    from eqmoe.data.hub import MODEL_FILES, TOKENIZER_FILES

    for name in ("tiktoken.model", "tokenization_kimi.py", "tokenizer_config.json"):
        assert any(fnmatch.fnmatch(name, pattern) for pattern in TOKENIZER_FILES), name
        assert any(fnmatch.fnmatch(name, pattern) for pattern in MODEL_FILES), name
    (tmp_path / "scratch").mkdir()
    extra = export_files(None, tmp_path, tmp_path / "scratch", BASE + 256, tokenizer=folder)
    names = {path.name for path in extra.files}
    assert {"tiktoken.model", "tokenization_kimi.py", "tokenizer_config.json", "generation_config.json"} <= names
    assert "tokenizer.json" not in names and f"stops on ids [{BASE + 2}]" in extra.note
    out = tmp_path / "out"
    out.mkdir()
    for path in extra.files:
        shutil.copyfile(path, out / path.name)
    again, tok = load_tokenizer(out), load_tokenizer(folder)
    assert isinstance(again, TiktokenTokenizer) and again.special_ids == tok.special_ids
    assert json.loads((out / "tokenizer_config.json").read_text())["auto_map"]["AutoTokenizer"][0].startswith(
        "tokenization_kimi."
    )
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert render(chat, again) == render(chat, tok) and again.encode(TEXTS[2]) == tok.encode(TEXTS[2])
    with pytest.raises(ValueError, match=f"has {BASE + 256} ids but the model's vocabulary has {BASE}"):
        export_files(None, tmp_path, tmp_path / "scratch", BASE, tokenizer=folder)


def test_transformers_tiktoken_converter_agrees(folder):
    """transformers' own reading of a tiktoken file (TikTokenConverter, given Kimi's pattern and the specials in id
    order) tokenizes as eqmoe does."""
    convert = pytest.importorskip("transformers.convert_slow_tokenizer")
    tok = load_tokenizer(folder)
    specials = [tok.special_ids[i] for i in range(BASE, BASE + 256)]
    converted = convert.TikTokenConverter(
        vocab_file=str(folder / "tiktoken.model"), pattern=PUBLISHED_PAT_STR, extra_special_tokens=specials
    ).converted()
    assert converted.get_vocab_size(with_added_tokens=True) == tok.vocab_size
    for text in TEXTS:
        assert converted.encode(text, add_special_tokens=False).ids == tok.encode(text), text


def test_commands_pick_a_model_folders_tiktoken_tokenizer(folder, tmp_path):
    """Every command that defaults to a model folder's tokenizer finds its tiktoken.model, not only a tokenizer.json."""
    from eqmoe.checkpoints.source import ModelSource, source_tokenizer
    from experiments import check_logits, convert, pretrain

    own = source_tokenizer(ModelSource(None, folder, None))  # generate, analyze_routing, sft
    assert isinstance(own, TiktokenTokenizer) and own.path == str(folder / "tiktoken.model")
    text = pretrain._tokenizer(pretrain.Args(model=pretrain.ModelOptions(init_from_hf=folder)))
    assert isinstance(text, TiktokenTokenizer) and not text.chat
    assert check_logits._tokenizer_path(check_logits.Args(hf=folder)) == folder / "tiktoken.model"
    assert check_logits._tokenizer_path(check_logits.Args(hf=tmp_path, tokenizer=folder)) == folder / "tiktoken.model"
    (tmp_path / "empty").mkdir()
    looked = "no tokenizer in this folder (looked for tokenizer.json and tiktoken.model"
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path / 'empty'}: {looked}")):
        source_tokenizer(ModelSource(None, tmp_path / "empty", None))
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path / 'empty'}: {looked}")):
        check_logits._tokenizer_path(check_logits.Args(hf=folder, tokenizer=tmp_path / "empty"))

    # From a checkpoint whose run recorded its tokenizer, pretrain finds it by sft's rule, and names one that moved
    # (it used to fall back to bytes without a word)
    from eqmoe import presets
    from eqmoe.checkpoints.orbax import Checkpointer
    from eqmoe.checkpoints.run_metadata import RunMetadata

    for name, recorded in (("ckpt", folder), ("moved", tmp_path / "gone")):
        with Checkpointer(tmp_path / name) as checkpointer:
            metadata = RunMetadata(presets.get("qwen3-moe-micro"), tokenizer=str(recorded))
            checkpointer.save(0, {"x": np.zeros(1)}, metadata.to_json())
    start = lambda name: pretrain.Args(model=pretrain.ModelOptions(init_from_checkpoint=tmp_path / name))  # noqa: E731
    assert pretrain._tokenizer(start("ckpt")).path == str(folder / "tiktoken.model")
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path / 'gone'}: tokenizer not found")):
        pretrain._tokenizer(start("moved"))

    # convert --hf: the folder's tiktoken.model is the tokenizer checked against the vocabulary; a --tokenizer that
    # is one brings its own tokenizer_config.json (its special tokens) and tokenization code in place of the source's
    names = {path.name for path in convert._side_files(folder, None, BASE + 256)}
    assert {"tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py"} <= names
    with pytest.raises(convert.UsageError, match=f"tiktoken.model: the tokenizer has {BASE + 256} ids but"):
        convert._side_files(folder, None, BASE + 255)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer_config.json").write_text("{}")
    (plain / "tokenizer.json").write_text("{}")
    files = convert._side_files(plain, folder, BASE + 256)
    assert sorted(files) == sorted(
        folder / name for name in ("tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py")
    )
    with pytest.raises(convert.UsageError, match=re.escape(f"{tmp_path / 'empty'}: {looked}")):
        convert._side_files(folder, tmp_path / "empty", BASE + 256)


def test_tokenized_cache_key_holds_the_tiktoken_special_tokens(folder, tmp_path):
    """A tiktoken.model's special tokens are named in the tokenizer_config.json beside it: renaming one changes the
    key of the tokenised data; a tokenizer.json's key is its file's digest, as before."""
    import hashlib

    from eqmoe.data.tokenized import _tokenizer_identity, cache_key

    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    tok = load_tokenizer(folder)
    before = cache_key(data, tok, None, None)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"][str(BASE + 5)] = {"content": "<|tool|>", "special": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    after = load_tokenizer(folder)  # the same tiktoken.model and template, another special token
    assert after.special_ids[BASE + 5] == "<|tool|>" and after.chat_template.sources == tok.chat_template.sources
    assert cache_key(data, after, None, None) != before

    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    words = HFTokenizer.from_file(tmp_path / "tokenizer.json", chat=False)
    assert _tokenizer_identity(words) == hashlib.sha256((tmp_path / "tokenizer.json").read_bytes()).hexdigest()


def _kimi_model_folder(folder):
    """A tiny DeepSeek-V3 saved by transformers as Kimi K2 publishes its folders: ``model_type: kimi_k2`` and a
    tiktoken.model with Kimi's tokenizer_config.json, no tokenizer.json; the vocabulary is the tokenizer's."""
    from tests.test_deepseek import V3

    V3.save_tiny(folder, seed=0, vocab_size=BASE + 256, num_hidden_layers=2)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}, indent=2))
    return _kimi_folder(folder)


# -m slow (13 s): the commands' choice of the folder's tiktoken tokenizer and the exports carrying it run by default
# (test_commands_pick_a_model_folders_tiktoken_tokenizer, test_hub_downloads_and_exports_carry_tiktoken_model)
@pytest.mark.slow
def test_sft_from_a_kimi_folder_trains_on_its_tiktoken_tokenizer_and_exports_it(tmp_path, capsys):
    """sft --init-from-hf on a Kimi K2 folder renders and tokenises with its tiktoken tokenizer (not the byte
    tokenizer), and convert --to-hf carries tiktoken.model, tokenizer_config.json and the tokenization code."""
    pytest.importorskip("transformers")
    from eqmoe.checkpoints import hf
    from eqmoe.checkpoints.model_checkpoint import load_model
    from experiments import convert, sft

    kimi = _kimi_model_folder(tmp_path / "kimi")
    assert not (kimi / "tokenizer.json").exists() and hf.read_config(kimi).family == "deepseek_v3"
    replies = ["你好 world", "hello world", "abc 12", "it's hello"]
    with open(tmp_path / "chats.jsonl", "w") as handle:
        for i in range(24):
            messages = [
                {"role": "user", "content": f"hello {i}"},
                {"role": "assistant", "content": replies[i % len(replies)]},
            ]
            handle.write(json.dumps({"messages": messages}) + "\n")
    args = sft.Args(
        model=sft.ModelOptions(init_from_hf=kimi, lora_rank=4, lora_targets=("attention", "experts")),
        data=sft.DataOptions(data=tmp_path / "chats.jsonl", seq_len=32, batch_size=4, cache_dir=tmp_path / "cache"),
        run=sft.RunOptions(
            steps=2, out_dir=tmp_path / "run", checkpoint_every=2, eval_every=1000, log_every=1, samples=0
        ),
    )
    assert sft.main(args) == 0
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "tokenizer:" in line)
    assert f"tokenizer: TiktokenTokenizer({str(kimi / 'tiktoken.model')!r}, vocab_size={BASE + 256})" in line, line
    assert "(the starting model's)" in line and f"template: {kimi / 'tokenizer_config.json'}" in line, line
    assert "ByteTokenizer" not in err and "tokenised before" not in err
    checkpoints = tmp_path / "run" / "checkpoints"
    _, metadata = load_model(checkpoints)
    assert metadata.tokenizer == str((kimi / "tiktoken.model").absolute()) and not metadata.bytes_tokenizer

    assert convert.main(convert.Args(checkpoint=checkpoints, to_hf=tmp_path / "out")) == 0
    out = tmp_path / "out"
    assert {"tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py"} <= {p.name for p in out.iterdir()}
    assert not (out / "tokenizer.json").exists()
    assert (out / "tiktoken.model").read_bytes() == (kimi / "tiktoken.model").read_bytes()
    again, tok = load_tokenizer(out), load_tokenizer(kimi)
    assert isinstance(again, TiktokenTokenizer) and again.special_ids == tok.special_ids
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert render(chat, again) == render(chat, tok)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == BASE + 2
