"""Tokenizers: a file-free byte tokenizer and a Hugging Face tokenizer folder, each with its chat template.

A folder's tokenizer is its ``tokenizer.json`` (:class:`HFTokenizer`), else its ``tiktoken.model``
(:class:`TiktokenTokenizer`: the Kimi family, whose folders ship no ``tokenizer.json``); a folder with neither is
refused, naming both.

Both follow the :class:`Tokenizer` protocol used by :mod:`eqmoe.data.chat`: ``encode(text)`` returns ids
without added special tokens (a special token spelled out in the text is that token, as in Hugging Face's
``tokenizers``), ``encode_with_offsets`` adds each token's ``[start, end)`` character span, ``decode(ids)``
renders special tokens as their strings, ``chat_template`` renders conversations (:mod:`eqmoe.data.template`)
and ``stop_ids`` are the ids generation stops on besides the template's end of turn (``generation_config.json``'s
``eos_token_id``). ``<|endoftext|>`` is the document delimiter (``bos_id`` and ``eos_id``, as in Qwen).

:class:`ByteTokenizer` needs no files: ids ``0..255`` are the UTF-8 bytes, then ``<|pad|>`` (256),
``<|endoftext|>`` (257), ``<|im_start|>`` (258) and ``<|im_end|>`` (259); ``vocab_size`` is 260. Its
template is the built-in ChatML.
"""

import base64
import binascii
import contextlib
import itertools
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
from jaxtyping import Int32, Int64

from eqmoe.data.hub import resolve_folder
from eqmoe.data.template import CHATML, ChatTemplate, folder_template, read_template_file, special_tokens

PAD = "<|pad|>"
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CHAT_SPECIALS = (IM_START, IM_END, ENDOFTEXT)


@runtime_checkable
class Tokenizer(Protocol):
    """What the chat template, the packer and generation need from a tokenizer."""

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    im_start_id: int
    im_end_id: int

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, with no special tokens added."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; special tokens appear as their strings."""
        ...

    chat_template: ChatTemplate
    stop_ids: tuple[int, ...]
    special_ids: Mapping[int, str]  # id -> text of every special token

    def encode_with_offsets(self, texts: list[str]) -> list[tuple[Int32[np.ndarray, "n"], Int64[np.ndarray, "n 2"]]]:
        """Each text's ids and their ``[start, end)`` character spans."""
        ...

    def token_to_id(self, token: str) -> int | None:
        """The id of a special or vocabulary token, ``None`` when there is none."""
        ...


def _as_ints(ids: Iterable[int] | np.ndarray) -> list[int]:
    return [int(i) for i in ids]  # NumPy and JAX integers too


class ByteTokenizer:
    """UTF-8 bytes plus four specials; ``vocab_size = 260``."""

    SPECIALS = (PAD, ENDOFTEXT, IM_START, IM_END)
    vocab_size: int = 260
    pad_id: int = 256
    bos_id: int = 257
    eos_id: int = 257
    im_start_id: int = 258
    im_end_id: int = 259
    stop_ids: tuple[int, ...] = ()
    special_ids: Mapping[int, str] = dict(enumerate(SPECIALS, start=256))
    _SPLIT = re.compile("(" + "|".join(map(re.escape, SPECIALS)) + ")")

    def __init__(self, chat_template: ChatTemplate | None = None):
        self.chat_template = chat_template or ChatTemplate(CHATML, "built-in ChatML")

    def token_to_id(self, token: str) -> int | None:
        return 256 + self.SPECIALS.index(token) if token in self.SPECIALS else None

    def encode(self, text: str) -> list[int]:
        return self.encode_with_offsets([text])[0][0].tolist()

    def encode_with_offsets(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        return [self._encode_one(text) for text in texts]

    def _encode_one(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        ids, starts, ends, at = [], [], [], 0
        for piece in self._SPLIT.split(text):
            if piece in self.SPECIALS:
                ids.append(np.asarray([256 + self.SPECIALS.index(piece)], np.int32))
                starts.append(np.asarray([at]))
            elif piece:
                data = np.frombuffer(piece.encode("utf-8"), np.uint8)
                ids.append(data.astype(np.int32))
                # A multi-byte character's bytes all span that character.
                starts.append(at + np.cumsum((data & 0xC0) != 0x80) - 1)
            at += len(piece)
            if piece:
                ends.append(starts[-1] + 1)
        if not ids:
            return np.zeros(0, np.int32), np.zeros((0, 2), np.int64)
        return np.concatenate(ids), np.stack([np.concatenate(starts), np.concatenate(ends)], -1).astype(np.int64)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        parts: list[str] = []
        pending = bytearray()
        for i in _as_ints(ids):
            if 0 <= i < 256:
                pending.append(i)
                continue
            if not 256 <= i < self.vocab_size:
                raise ValueError(f"ByteTokenizer.decode: id {i} is outside 0..{self.vocab_size - 1}")
            parts.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            parts.append(self.SPECIALS[i - 256])
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=260)"


class HFTokenizer:
    """A Hugging Face tokenizer (``tokenizer.json``) with its folder's chat template and stop ids.

    ``bos_id`` and ``eos_id`` are ``<|endoftext|>`` (the document delimiter) when the vocabulary has it,
    else ``tokenizer_config.json``'s ``eos_token``; ``pad_id`` is ``<|pad|>``, else the config's
    ``pad_token``, else ``eos_id``. Text is encoded without the post-processor's special tokens; a special
    token spelled out inside the text is matched by the ``tokenizers`` library as that special token. The
    chat template is the folder's (see :func:`load_tokenizer`); without one it is the built-in ChatML, which
    needs ``<|im_start|>``, ``<|im_end|>`` and ``<|endoftext|>`` in the vocabulary.

    ``chat=False`` reads any ``tokenizer.json`` for plain text, as Hugging Face applies it (generation
    from a prompt, logit checks): ``encode`` adds the post-processor's special tokens, ``decode`` skips
    special tokens, and no chat special is required.
    """

    def __init__(
        self,
        tokenizer,
        path: str = "<memory>",
        *,
        chat: bool = True,
        config: Mapping[str, Any] | None = None,
        chat_template: ChatTemplate | None = None,
        stop_ids: tuple[int, ...] = (),
    ):
        self._tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self._setup(
            path,
            chat,
            config,
            chat_template,
            stop_ids,
            vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
            special_ids={i: token.content for i, token in added.items() if token.special},
        )

    def _setup(
        self,
        path: str,
        chat: bool,
        config: Mapping[str, Any] | None,
        chat_template: ChatTemplate | None,
        stop_ids: tuple[int, ...],
        *,
        vocab_size: int,
        special_ids: Mapping[int, str],
    ) -> None:
        """The ids and template every folder tokenizer derives alike from its vocabulary (``token_to_id``)."""
        self.path = path
        self.chat = chat
        self.special_tokens = special_tokens(config or {})
        ids = {name: self.token_to_id(name) for name in CHAT_SPECIALS}
        self.chat_template = chat_template or ChatTemplate(CHATML, "built-in ChatML", self.special_tokens)
        missing = [name for name, i in ids.items() if i is None]
        if missing and chat and chat_template is None:
            raise ValueError(
                f"{path}: the tokenizer has no chat template and lacks the special token(s) {', '.join(missing)} "
                f"that the built-in ChatML needs; add them, or give a template (--chat-template FILE)"
            )
        self.vocab_size: int = vocab_size
        self.im_start_id: int | None = ids[IM_START]
        self.im_end_id: int | None = ids[IM_END]
        eos = ids[ENDOFTEXT]
        if eos is None and "eos_token" in self.special_tokens:
            eos = self.token_to_id(self.special_tokens["eos_token"])
        self.bos_id: int | None = eos
        self.eos_id: int | None = eos
        pad = self.token_to_id(PAD)
        if pad is None and "pad_token" in self.special_tokens:
            pad = self.token_to_id(self.special_tokens["pad_token"])
        self.pad_id: int | None = eos if pad is None else pad
        self.stop_ids = tuple(stop_ids)
        self.special_ids = dict(special_ids)

    @classmethod
    def from_file(cls, path: str | Path, *, chat: bool = True) -> "HFTokenizer":
        """Load a ``tokenizer.json`` alone; ``ValueError`` naming the file when it is missing, invalid or (with
        ``chat``) lacks ``<|im_start|>``, ``<|im_end|>`` or ``<|endoftext|>``. A ``tiktoken.model`` loads as
        :class:`TiktokenTokenizer`, its special tokens from the ``tokenizer_config.json`` beside it."""
        path = Path(path)
        if path.name == TIKTOKEN_FILE:
            config = _read_json(path.parent / "tokenizer_config.json")
            return TiktokenTokenizer(read_tiktoken(path, config), str(path), chat=chat, config=config)
        return HFTokenizer(_read_tokenizer_json(path), str(path), chat=chat)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=not self.chat).ids)

    def encode_with_offsets(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [(np.asarray(e.ids, np.int32), np.asarray(e.offsets, np.int64).reshape(-1, 2)) for e in encodings]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        return self._tokenizer.decode(_as_ints(ids), skip_special_tokens=not self.chat)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


# The pre-tokenizer regex of the Kimi family's tiktoken tokenizers (``pat_str`` of ``TikTokenTokenizer`` in the
# ``tokenization_kimi.py`` that moonshotai/Kimi-K2-Instruct ships and the ``tokenization_moonshot.py`` of
# moonshotai/Moonlight-16B-A3B; identical in both). A ``tiktoken.model`` stores no regex, so it is supplied here.
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_FILE_NAMES = ("tokenizer.json", TIKTOKEN_FILE)  # what a folder's tokenizer loads from, in this order
RESERVED_SPECIALS = 256  # ids after the ranks that are special tokens, named ``<|reserved_token_{id}|>`` if unnamed
_MAX_CHUNK = 400_000  # tokenization_kimi.py encodes text in chunks of this many characters ...
_MAX_RUN = 25_000  # ... and cuts runs of whitespace or of non-whitespace longer than this (tiktoken issue 195)
_LONG_RUN = re.compile(rf"(?<!\S)\S{{{_MAX_RUN + 1},}}|(?<!\s)\s{{{_MAX_RUN + 1},}}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def tokenizer_file(folder: str | Path) -> Path | None:
    """The file a tokenizer folder loads from: ``tokenizer.json``, else ``tiktoken.model``; ``None`` if neither."""
    return next((Path(folder) / name for name in TOKENIZER_FILE_NAMES if (Path(folder) / name).is_file()), None)


def read_tiktoken(path: str | Path, config: Mapping[str, Any] | None = None):
    """A ``tiktoken.Encoding`` built as the Kimi family's ``tokenization_kimi.py`` builds it: the ranks of the
    ``tiktoken.model`` at ``path`` (a base64 token and its rank per line), :data:`KIMI_PATTERN`, and as special
    tokens the ``added_tokens_decoder`` of ``config`` (a ``tokenizer_config.json``) at or above the first id after
    the ranks, the :data:`RESERVED_SPECIALS` ids from there that it names none of being ``<|reserved_token_{id}|>``.
    (Moonlight's ``tokenization_moonshot.py`` reserves two ids more; they are left out, so that the vocabulary is
    the 256 ids after the ranks, as Kimi K2's code counts it.) Added tokens below the first id after the ranks
    are ignored, as there. ``ValueError`` in one line naming the file when it cannot be read."""
    path = Path(path)
    try:
        import tiktoken
    except ImportError:
        raise ValueError(
            f"{path}: reading a tiktoken.model needs the tiktoken package (pip install tiktoken)"
        ) from None
    try:
        lines = path.read_bytes().splitlines()
    except OSError as error:
        raise ValueError(f"{path}: cannot be read ({error.strerror or error})") from None
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except (ValueError, binascii.Error):
            shown = line[:40].decode("utf-8", errors="replace")
            raise ValueError(
                f"{path}: not a tiktoken.model (line {number}: expected a base64 token and a rank, found {shown!r})"
            ) from None
    base = len(ranks)
    if base == 0:
        raise ValueError(f"{path}: not a tiktoken.model (no tokens in it)")
    if sorted(ranks.values()) != list(range(base)):
        raise ValueError(f"{path}: not a tiktoken.model (the ranks of its {base} tokens are not 0..{base - 1})")
    missing = [byte for byte in range(256) if bytes([byte]) not in ranks]
    if missing:
        shown = ", ".join(map(hex, missing[:8])) + (", ..." if len(missing) > 8 else "")
        raise ValueError(f"{path}: not a tiktoken.model (lacks the single bytes {shown})")
    named = _added_tokens(config or {}, path.parent / "tokenizer_config.json")
    specials = {f"<|reserved_token_{i}|>": i for i in range(base, base + RESERVED_SPECIALS) if i not in named}
    specials.update({content: i for i, content in sorted(named.items()) if i >= base})
    return tiktoken.Encoding(name=str(path), pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def _added_tokens(config: Mapping[str, Any], where: Path) -> dict[int, str]:
    """``added_tokens_decoder`` of a ``tokenizer_config.json``: id -> content."""
    added = config.get("added_tokens_decoder") or {}
    if not isinstance(added, Mapping):
        raise ValueError(f"{where}: added_tokens_decoder is not an object of id -> token")
    found = {}
    for key, token in added.items():
        content = token.get("content") if isinstance(token, Mapping) else token
        if not (isinstance(key, str) and key.isdigit() and isinstance(content, str) and content):
            raise ValueError(f"{where}: added_tokens_decoder[{key!r}] is not an id with a token's content")
        found[int(key)] = content
    return found


def _pieces(text: str) -> list[str]:
    """``text`` cut as ``tokenization_kimi.py`` cuts it before encoding each piece: into chunks of
    :data:`_MAX_CHUNK` characters, and each chunk's runs of more than :data:`_MAX_RUN` whitespace or
    non-whitespace characters every :data:`_MAX_RUN` characters."""
    pieces = []
    for at in range(0, max(len(text), 1), _MAX_CHUNK):
        chunk = text[at : at + _MAX_CHUNK]
        cuts = [0]
        for run in _LONG_RUN.finditer(chunk):
            cuts.extend(range(run.start() + _MAX_RUN, run.end(), _MAX_RUN))
        cuts.append(len(chunk))
        pieces.extend(chunk[start:stop] for start, stop in itertools.pairwise(cuts))
    return pieces


class TiktokenTokenizer(HFTokenizer):
    """A Hugging Face folder whose tokenizer is a ``tiktoken.model`` (the Kimi family: Kimi K2, Moonlight), read
    with :func:`read_tiktoken` as their ``tokenization_kimi.py`` reads it, with the folder's chat template and
    stop ids as for :class:`HFTokenizer`. As there, a special token spelled out in the text is that token
    (``allowed_special="all"``); ``decode`` renders special tokens as their strings (skips them with
    ``chat=False``) and undecodable bytes as U+FFFD; ``token_to_id`` knows the special tokens and the tokens of
    the ranks (by their UTF-8 text). Surrogate code points in the text are encoded as U+FFFD."""

    def __init__(
        self,
        encoding,
        path: str = "<memory>",
        *,
        chat: bool = True,
        config: Mapping[str, Any] | None = None,
        chat_template: ChatTemplate | None = None,
        stop_ids: tuple[int, ...] = (),
    ):
        self._encoding = encoding
        self._specials = {token: encoding.encode_single_token(token) for token in encoding.special_tokens_set}
        self._special_set = frozenset(self._specials.values())
        self._lengths = np.zeros(encoding.n_vocab, np.int64)  # each id's length in bytes; 0: no such id
        for i in range(encoding.n_vocab):
            with contextlib.suppress(KeyError):
                self._lengths[i] = len(encoding.decode_single_token_bytes(i))
        self._setup(
            path,
            chat,
            config,
            chat_template,
            stop_ids,
            vocab_size=encoding.n_vocab,
            special_ids={i: token for token, i in self._specials.items()},
        )

    def token_to_id(self, token: str) -> int | None:
        if token in self._specials:
            return self._specials[token]
        try:
            return self._encoding.encode_single_token(token.encode("utf-8", errors="surrogatepass"))
        except KeyError:
            return None

    def _encode_all(self, texts: list[str]) -> list[list[int]]:
        pieces, owners = [], []
        for k, text in enumerate(texts):
            for piece in _pieces(text):
                pieces.append(piece)
                owners.append(k)
        encoded = self._encoding.encode_batch(pieces, allowed_special="all") if pieces else []
        ids: list[list[int]] = [[] for _ in texts]
        for k, piece_ids in zip(owners, encoded, strict=True):
            ids[k].extend(piece_ids)
        return ids

    def encode(self, text: str) -> list[int]:
        return self._encode_all([_valid_utf8(text)[0]])[0]

    def encode_with_offsets(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        valid = [_valid_utf8(text) for text in texts]
        return [
            self._with_offsets(data, ids)
            for (_, data), ids in zip(valid, self._encode_all([text for text, _ in valid]), strict=True)
        ]

    def _with_offsets(self, data: bytes, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The ids and each one's ``[start, end)`` character span; a token holding part of a character's bytes
        spans that whole character, as in Hugging Face's byte-level tokenizers."""
        ids = np.asarray(ids, np.int32)
        if not len(ids):
            return ids, np.zeros((0, 2), np.int64)
        raw = np.frombuffer(data, np.uint8)
        char_of_byte = np.cumsum((raw & 0xC0) != 0x80) - 1
        ends = np.cumsum(self._lengths[ids])
        starts = ends - self._lengths[ids]
        assert ends[-1] == len(raw), "the tokens' bytes are the text's bytes"
        return ids, np.stack([char_of_byte[starts], char_of_byte[ends - 1] + 1], -1).astype(np.int64)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        ids = _as_ints(ids)
        for i in ids:
            if not (0 <= i < self.vocab_size and self._lengths[i]):
                raise ValueError(f"{self.path}: id {i} is no token (ids are 0..{self.vocab_size - 1})")
        if not self.chat:
            ids = [i for i in ids if i not in self._special_set]
        return self._encoding.decode(ids)

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def _valid_utf8(text: str) -> tuple[str, bytes]:
    """``text`` with any surrogate code point replaced by U+FFFD (the length kept), and its UTF-8 bytes."""
    try:
        return text, text.encode("utf-8")
    except UnicodeEncodeError:
        text = _SURROGATE.sub("\ufffd", text)
        return text, text.encode("utf-8")


def load_tokenizer(
    path: str | Path | None,
    *,
    chat: bool = True,
    chat_template: str | Path | None = None,
    template_vars: Mapping[str, Any] | None = None,
) -> ByteTokenizer | HFTokenizer:
    """The tokenizer at ``path`` with its chat template; :class:`ByteTokenizer` when ``path`` is ``None``.

    ``path`` is a folder, a ``tokenizer.json``, a ``tiktoken.model`` or a Hub id ``ORG/NAME[@REVISION]``
    (:mod:`eqmoe.data.hub`); a folder's tokenizer is its ``tokenizer.json``, else its ``tiktoken.model``
    (:class:`TiktokenTokenizer`), else ``ValueError`` naming the folder and both files. The folder (the file's, for a
    file) also gives ``tokenizer_config.json`` (named special tokens, ``chat_template``),
    ``chat_template.jinja`` and ``generation_config.json`` (``eos_token_id``: the stop ids). ``chat_template`` (a
    ``.jinja`` file, or a ``tokenizer_config.json``) replaces the folder's template; ``template_vars`` (e.g.
    ``enable_thinking``) are passed to every render."""
    variables = dict(template_vars or {})
    if path is None:
        template = None if chat_template is None else read_template_file(chat_template, variables)
        return ByteTokenizer(template or ChatTemplate(CHATML, "built-in ChatML", variables))
    path = resolve_folder(path, files="tokenizer")
    folder, file = (path, tokenizer_file(path)) if path.is_dir() else (path.parent, path)
    if file is None:
        raise ValueError(f"{folder}: no tokenizer in this folder (looked for {' and '.join(TOKENIZER_FILE_NAMES)})")
    config = _read_json(folder / "tokenizer_config.json")
    variables = {**special_tokens(config), **variables}
    if chat_template is not None:
        template = read_template_file(chat_template, variables)
    else:
        template = folder_template(folder, config, variables)
    if template is None and variables.keys() - special_tokens(config).keys():
        template = ChatTemplate(CHATML, "built-in ChatML", variables)
    generation = _read_json(folder / "generation_config.json")
    stops = generation.get("eos_token_id", [])
    stops = [stops] if isinstance(stops, int) else stops
    stop_ids = tuple(i for i in stops if isinstance(i, int) and not isinstance(i, bool))
    if file.name == TIKTOKEN_FILE:
        encoding = read_tiktoken(file, config)
        return TiktokenTokenizer(
            encoding, str(file), chat=chat, config=config, chat_template=template, stop_ids=stop_ids
        )
    return HFTokenizer(
        _read_tokenizer_json(file), str(file), chat=chat, config=config, chat_template=template, stop_ids=stop_ids
    )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return value


def _read_tokenizer_json(path: str | Path):
    from tokenizers import Tokenizer as _HF

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: tokenizer file not found")
    try:
        return _HF.from_file(str(path))
    except Exception as error:  # the library raises a bare Exception for every parse failure
        raise ValueError(f"{path}: not a valid Hugging Face tokenizer.json ({error})") from None


def tokenizer_vocab_size(path: str | Path) -> int:
    """How many ids a ``tokenizer.json`` can produce (added tokens included), or a ``tiktoken.model`` with the
    special tokens of the ``tokenizer_config.json`` beside it; needs no chat specials."""
    path = Path(path)
    if path.name == TIKTOKEN_FILE:
        return read_tiktoken(path, _read_json(path.parent / "tokenizer_config.json")).n_vocab
    return _read_tokenizer_json(path).get_vocab_size(with_added_tokens=True)
