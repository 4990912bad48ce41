"""A Hugging Face folder's tokenizer: its ``tokenizer.json`` (:class:`HFTokenizer`), or its ``tiktoken.model``
(:class:`TiktokenTokenizer`, an :class:`HFTokenizer` whose vocabulary is tiktoken's), each with the folder's chat
template and stop ids."""

import contextlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from eqmoe.data.template import CHATML, ChatTemplate, special_tokens
from eqmoe.data.tokenizers.base import CHAT_SPECIALS, ENDOFTEXT, IM_END, IM_START, PAD, as_ints, read_json
from eqmoe.data.tokenizers.tiktoken_model import TIKTOKEN_FILE, read_tiktoken, text_pieces, valid_utf8


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
            config = read_json(path.parent / "tokenizer_config.json")
            return TiktokenTokenizer(read_tiktoken(path, config), str(path), chat=chat, config=config)
        return HFTokenizer(read_tokenizer_json(path), str(path), chat=chat)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=not self.chat).ids)

    def encode_with_offsets(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [(np.asarray(e.ids, np.int32), np.asarray(e.offsets, np.int64).reshape(-1, 2)) for e in encodings]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        return self._tokenizer.decode(as_ints(ids), skip_special_tokens=not self.chat)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


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
            for piece in text_pieces(text):
                pieces.append(piece)
                owners.append(k)
        encoded = self._encoding.encode_batch(pieces, allowed_special="all") if pieces else []
        ids: list[list[int]] = [[] for _ in texts]
        for k, piece_ids in zip(owners, encoded, strict=True):
            ids[k].extend(piece_ids)
        return ids

    def encode(self, text: str) -> list[int]:
        return self._encode_all([valid_utf8(text)[0]])[0]

    def encode_with_offsets(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        valid = [valid_utf8(text) for text in texts]
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
        ids = as_ints(ids)
        for i in ids:
            if not (0 <= i < self.vocab_size and self._lengths[i]):
                raise ValueError(f"{self.path}: id {i} is no token (ids are 0..{self.vocab_size - 1})")
        if not self.chat:
            ids = [i for i in ids if i not in self._special_set]
        return self._encoding.decode(ids)

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def read_tokenizer_json(path: str | Path):
    from tokenizers import Tokenizer as _HF

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: tokenizer file not found")
    try:
        return _HF.from_file(str(path))
    except Exception as error:  # the library raises a bare Exception for every parse failure
        raise ValueError(f"{path}: not a valid Hugging Face tokenizer.json ({error})") from None
