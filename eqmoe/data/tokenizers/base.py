"""What every tokenizer is: the :class:`Tokenizer` protocol, the chat special tokens' names and the small readers
the tokenizer kinds share."""

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
from jaxtyping import Int32, Int64

from eqmoe.data.template import ChatTemplate

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


def as_ints(ids: Iterable[int] | np.ndarray) -> list[int]:
    return [int(i) for i in ids]  # NumPy and JAX integers too


def read_json(path: Path) -> dict:
    """The JSON object in ``path`` (a tokenizer folder's config files), ``{}`` when there is no such file."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return value
