"""Built-in synthetic chat tasks: short, deterministic answers a tiny model learns in minutes.

Five kinds, each a one-turn conversation ``[user, assistant]``:

- ``"add"``: ``"What is 37+58?"`` -> ``"95"`` (two numbers in ``0..99``, written with two digits:
  ``"What is 07+58?"`` -> ``"65"``, so each digit sits at the same place in every prompt; with the numbers'
  own widths the micro model learnt addition on one seed in three within the SFT budget);
- ``"reverse"``: ``"Reverse: hello"`` -> ``"olleh"`` (3-6 random lowercase letters);
- ``"sort"``: ``"Sort: 5 2 9"`` -> ``"2 5 9"`` (3-5 digits, ascending);
- ``"max"``: ``"Largest: 5 2 9"`` -> ``"9"`` (3-6 digits);
- ``"count"``: ``"How many a in banana?"`` -> ``"3"`` (a 3-7 letter word where the asked letter is
  frequent, so the counts spread over ``0..7``).

The default set :data:`KINDS` leaves ``count`` out: in the SFT default's budget of a few CPU minutes the
``qwen3-moe-micro`` model reaches ~99% on reverse and sort but only ~45% on counting, which is a task
for a larger model or a longer run (pass ``kinds=ALL_KINDS``). :data:`TRAIN_MIX`, the SFT default's
training cycle, draws addition twice as often as the others: with an even mix, whether the micro model
learnt carrying within the budget depended on the seed (held-out addition 0.39-0.77 over seeds 0-2,
every other task 0.99-1.00).

Example ``index`` of ``seed`` depends on ``(seed, index)`` only: its kind is ``kinds[index % len(kinds)]``
and its content comes from ``random.Random`` seeded with the string ``"eqmoe.tasks/{seed}/{index}"``
(seeded through SHA-512, so the same on every run and machine). Whether a prompt is held out depends on
the prompt text alone: :func:`split_of` puts it in ``"eval"`` when ``zlib.crc32(prompt) % 100 < 10``, so
the train and eval splits never share a prompt, whatever the seeds.
"""

import random
import string
import zlib
from typing import Literal, NamedTuple

TaskKind = Literal["add", "reverse", "sort", "max", "count"]
KINDS: tuple[TaskKind, ...] = ("add", "reverse", "sort", "max")
ALL_KINDS: tuple[TaskKind, ...] = ("add", "reverse", "sort", "max", "count")
TRAIN_MIX: tuple[TaskKind, ...] = ("add", "reverse", "add", "sort", "max")
EVAL_PERCENT = 10
Split = Literal["train", "eval"]


class Example(NamedTuple):
    """One conversation ``[{"role": "user", ...}, {"role": "assistant", ...}]`` and its task kind."""

    messages: list[dict[str, str]]
    task: str

    @property
    def prompt(self) -> str:
        return self.messages[0]["content"]

    @property
    def answer(self) -> str:
        return self.messages[-1]["content"]


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"What is {a:02d}+{b:02d}?", str(a + b)


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
    return f"Reverse: {word}", word[::-1]


def _sort(rng: random.Random) -> tuple[str, str]:
    digits = [rng.randint(0, 9) for _ in range(rng.randint(3, 5))]
    return "Sort: " + " ".join(map(str, digits)), " ".join(map(str, sorted(digits)))


def _max(rng: random.Random) -> tuple[str, str]:
    digits = [rng.randint(0, 9) for _ in range(rng.randint(3, 6))]
    return "Largest: " + " ".join(map(str, digits)), str(max(digits))


def _count(rng: random.Random) -> tuple[str, str]:
    letter = rng.choice(string.ascii_lowercase)
    others = string.ascii_lowercase.replace(letter, "")
    word = "".join(letter if rng.random() < 0.35 else rng.choice(others) for _ in range(rng.randint(3, 7)))
    return f"How many {letter} in {word}?", str(word.count(letter))


_GENERATORS = {"add": _add, "reverse": _reverse, "sort": _sort, "max": _max, "count": _count}


def _check_kinds(kinds: tuple[str, ...]) -> None:
    if not kinds or any(kind not in _GENERATORS for kind in kinds):
        raise ValueError(f"kinds={kinds!r} is invalid; allowed: a non-empty tuple of {' | '.join(ALL_KINDS)}")


def make_example(seed: int, index: int, kinds: tuple[TaskKind, ...] = KINDS) -> Example:
    """Example ``index`` of the stream for ``seed`` (train and eval prompts alike)."""
    _check_kinds(kinds)
    kind = kinds[index % len(kinds)]
    prompt, answer = _GENERATORS[kind](random.Random(f"eqmoe.tasks/{seed}/{index}"))
    return Example([{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}], kind)


def split_of(prompt: str) -> Split:
    """``"eval"`` for the ~10% of prompts whose CRC-32 falls below ``EVAL_PERCENT`` (mod 100), else ``"train"``."""
    return "eval" if zlib.crc32(prompt.encode("utf-8")) % 100 < EVAL_PERCENT else "train"


def distinct_kinds(kinds: tuple[TaskKind, ...]) -> tuple[TaskKind, ...]:
    """``kinds`` with repeats dropped, in order of first appearance (a training mix's held-out cycle)."""
    return tuple(dict.fromkeys(kinds))


def synthetic_split(split: Split, n: int, seed: int = 0, kinds: tuple[TaskKind, ...] = KINDS) -> list[Example]:
    """The first ``n`` examples of ``seed``'s stream whose prompt belongs to ``split``, the kinds drawn in
    the cycle ``kinds`` (a kind listed twice is drawn twice as often).

    Deterministic; the ``"train"`` and ``"eval"`` results never share a prompt (for any seeds). Prompts
    may repeat within a split (``"sort"`` with 3 digits has only 1,000 prompts).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} is invalid; allowed: train | eval")
    if n < 0:
        raise ValueError(f"n={n} is invalid; allowed: a non-negative number")
    _check_kinds(kinds)
    examples: list[Example] = []
    index = 0
    while len(examples) < n:
        example = make_example(seed, index, kinds)
        if split_of(example.prompt) == split:
            examples.append(example)
        index += 1
    return examples
