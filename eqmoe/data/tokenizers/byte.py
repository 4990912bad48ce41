"""The file-free byte tokenizer: ids ``0..255`` are the UTF-8 bytes, then ``<|pad|>`` (256), ``<|endoftext|>``
(257), ``<|im_start|>`` (258) and ``<|im_end|>`` (259); ``vocab_size`` is 260. Its template is the built-in ChatML."""

import re
from collections.abc import Iterable, Mapping

import numpy as np

from eqmoe.data.template import CHATML, ChatTemplate
from eqmoe.data.tokenizers.base import ENDOFTEXT, IM_END, IM_START, PAD, as_ints


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
        # whole-text array operations: a loop over the specials' pieces made encoding the quickstart's 50,000
        # conversations take seconds
        data = np.frombuffer(text.encode("utf-8"), np.uint8)
        ids = data.astype(np.int32)
        if text.isascii():
            starts = first_byte = np.arange(len(data))
        else:
            leads = (data & 0xC0) != 0x80
            starts = np.cumsum(leads) - 1  # a multi-byte character's bytes all span that character
            first_byte = np.flatnonzero(leads)  # of each character
        specials = list(self._SPLIT.finditer(text))
        if specials:
            keep = np.ones(len(data), bool)
            for match in specials:
                at = first_byte[match.start()]
                ids[at] = 256 + self.SPECIALS.index(match.group())
                keep[at + 1 : at + len(match.group())] = False  # the specials are ASCII: a byte per character
            ids, starts = ids[keep], starts[keep]
        return ids, np.stack([starts, starts + 1], -1).astype(np.int64)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        parts: list[str] = []
        pending = bytearray()
        for i in as_ints(ids):
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
