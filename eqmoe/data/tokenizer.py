"""Tokenizers: a file-free byte tokenizer and a Hugging Face tokenizer folder, each with its chat template.

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
        self.path = path
        self.chat = chat
        self.special_tokens = special_tokens(config or {})
        ids = {name: tokenizer.token_to_id(name) for name in CHAT_SPECIALS}
        self.chat_template = chat_template or ChatTemplate(CHATML, "built-in ChatML", self.special_tokens)
        missing = [name for name, i in ids.items() if i is None]
        if missing and chat and chat_template is None:
            raise ValueError(
                f"{path}: the tokenizer has no chat template and lacks the special token(s) {', '.join(missing)} "
                f"that the built-in ChatML needs; add them, or give a template (--chat-template FILE)"
            )
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.im_start_id: int | None = ids[IM_START]
        self.im_end_id: int | None = ids[IM_END]
        eos = ids[ENDOFTEXT]
        if eos is None and "eos_token" in self.special_tokens:
            eos = tokenizer.token_to_id(self.special_tokens["eos_token"])
        self.bos_id: int | None = eos
        self.eos_id: int | None = eos
        pad = tokenizer.token_to_id(PAD)
        if pad is None and "pad_token" in self.special_tokens:
            pad = tokenizer.token_to_id(self.special_tokens["pad_token"])
        self.pad_id: int | None = eos if pad is None else pad
        self.stop_ids = tuple(stop_ids)
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids = {i: token.content for i, token in added.items() if token.special}

    @classmethod
    def from_file(cls, path: str | Path, *, chat: bool = True) -> "HFTokenizer":
        """Load a ``tokenizer.json`` alone; ``ValueError`` naming the file when it is missing, invalid or (with
        ``chat``) lacks ``<|im_start|>``, ``<|im_end|>`` or ``<|endoftext|>``."""
        return cls(_read_tokenizer_json(path), str(path), chat=chat)

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


def load_tokenizer(
    path: str | Path | None,
    *,
    chat: bool = True,
    chat_template: str | Path | None = None,
    template_vars: Mapping[str, Any] | None = None,
) -> ByteTokenizer | HFTokenizer:
    """The tokenizer at ``path`` with its chat template; :class:`ByteTokenizer` when ``path`` is ``None``.

    ``path`` is a folder, a ``tokenizer.json`` or a Hub id ``ORG/NAME[@REVISION]`` (:mod:`eqmoe.data.hub`); the
    folder (the file's, for a file) also gives ``tokenizer_config.json`` (named special tokens, ``chat_template``),
    ``chat_template.jinja`` and ``generation_config.json`` (``eos_token_id``: the stop ids). ``chat_template`` (a
    ``.jinja`` file, or a ``tokenizer_config.json``) replaces the folder's template; ``template_vars`` (e.g.
    ``enable_thinking``) are passed to every render."""
    variables = dict(template_vars or {})
    if path is None:
        template = None if chat_template is None else read_template_file(chat_template, variables)
        return ByteTokenizer(template or ChatTemplate(CHATML, "built-in ChatML", variables))
    path = resolve_folder(path, files="tokenizer")
    folder, file = (path, path / "tokenizer.json") if path.is_dir() else (path.parent, path)
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
    """How many ids a ``tokenizer.json`` can produce (added tokens included); needs no chat specials."""
    return _read_tokenizer_json(path).get_vocab_size(with_added_tokens=True)
