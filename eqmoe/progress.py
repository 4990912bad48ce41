"""Progress bars for the long phases (tokenising, evaluation, loading and writing checkpoints): tqdm on a
terminal, nothing otherwise (CI logs keep their plain lines)."""

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def phase_bar(items: Iterable[T], description: str, *, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """``items``, with a bar on stderr when it is a terminal (``tqdm(disable=None)``); removed when done."""
    from tqdm import tqdm

    return iter(tqdm(items, desc=description, total=total, unit=unit, file=sys.stderr, disable=None, leave=False))
