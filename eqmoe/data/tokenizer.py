"""Tokenizers: a file-free byte tokenizer and a Hugging Face ``tokenizer.json`` wrapper.

Both follow the :class:`Tokenizer` protocol used by :mod:`eqmoe.data.chat`: ``encode(text)`` returns ids
without any special tokens, ``decode(ids)`` renders special tokens as their strings, and the ids of the
ChatML specials are attributes. ``<|endoftext|>`` is the document delimiter (``bos_id`` and ``eos_id``,
as in Qwen); a chat turn ends with ``<|im_end|>`` (``im_end_id``), which is where generation stops.

:class:`ByteTokenizer` needs no files: ids ``0..255`` are the UTF-8 bytes, then ``<|pad|>`` (256),
``<|endoftext|>`` (257), ``<|im_start|>`` (258) and ``<|im_end|>`` (259); ``vocab_size`` is 260. Its
``encode`` never produces a special id, even when the text spells one out.
"""

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

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

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

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
    """A Hugging Face ``tokenizers.Tokenizer`` (from ``tokenizer.json``) with the ChatML specials.

    ``pad_id`` is ``<|pad|>`` when the vocabulary has it, otherwise ``<|endoftext|>`` (Qwen's choice).
    Text is encoded without the post-processor's special tokens; a special token spelled out inside the
    text is matched by the ``tokenizers`` library as that special token.

    ``chat=False`` reads any ``tokenizer.json`` for plain text, as Hugging Face applies it (generation
    from a prompt, logit checks): ``encode`` adds the post-processor's special tokens, ``decode`` skips
    special tokens, and the ChatML ids are ``None`` where the vocabulary lacks them.
    """

    def __init__(self, tokenizer, path: str = "<memory>", *, chat: bool = True):
        self._tokenizer = tokenizer
        self.path = path
        self.chat = chat
        ids = {name: tokenizer.token_to_id(name) for name in CHAT_SPECIALS}
        missing = [name for name, i in ids.items() if i is None]
        if missing and chat:
            raise ValueError(
                f"{path}: tokenizer lacks the chat special token(s) {', '.join(missing)} "
                f"(needed: {', '.join(CHAT_SPECIALS)}); add them as special tokens"
            )
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.im_start_id: int = ids[IM_START]
        self.im_end_id: int = ids[IM_END]
        self.bos_id: int = ids[ENDOFTEXT]
        self.eos_id: int = ids[ENDOFTEXT]
        pad = tokenizer.token_to_id(PAD)
        self.pad_id: int = ids[ENDOFTEXT] if pad is None else pad

    @classmethod
    def from_file(cls, path: str | Path, *, chat: bool = True) -> "HFTokenizer":
        """Load a ``tokenizer.json``; ``ValueError`` naming the file when it is missing, invalid or (with
        ``chat``) lacks ``<|im_start|>``, ``<|im_end|>`` or ``<|endoftext|>``."""
        return cls(_read_tokenizer_json(path), str(path), chat=chat)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=not self.chat).ids)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        return self._tokenizer.decode(_as_ints(ids), skip_special_tokens=not self.chat)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def load_tokenizer(path: str | Path | None, *, chat: bool = True) -> ByteTokenizer | HFTokenizer:
    """:class:`ByteTokenizer` when ``path`` is ``None``, else :meth:`HFTokenizer.from_file` (with ``chat``);
    a folder is read as ``folder/tokenizer.json``."""
    if path is None:
        return ByteTokenizer()
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    return HFTokenizer.from_file(path, chat=chat)


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
