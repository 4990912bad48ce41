"""Pretraining text: a built-in multi-domain corpus, local text and JSONL files, packed with domain labels.

The built-in corpus has four domains a router could tell apart, so expert specialisation is measurable
(:func:`eqmoe.analysis.routing.normalized_mutual_information`):

- ``"arithmetic"``: lines such as ``417+38=455`` (``+``, ``-``, ``*`` on numbers below 1000);
- ``"grammar"``: sentences of a small context-free grammar (``the red robot sees a cat near the hill .``);
- ``"strings"``: copy and reverse lines such as ``reverse: qzxrt > trxzq``;
- ``"python"``: the Python standard library's own source files, in ~1,000-character pieces (real
  text every machine with Python has; which text depends on the Python version).

Each synthetic domain is drawn from ``random.Random("eqmoe.corpus/{seed}/{split}/{domain}")`` (the same on
every machine); standard library pieces are held out when their index is ``19 mod 20``. Every domain
gets the same number of characters.

Local data: a ``.jsonl`` file holds one ``{"text": ..., "domain": ...}`` object per line (``domain``
optional, default the file's name); any other file is one UTF-8 document whose domain is its name.
"""

import functools
import random
import string
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np

from eqmoe.data.packing import Packed, pack
from eqmoe.data.records import iter_records
from eqmoe.data.tokenizer import Tokenizer

SYNTHETIC_DOMAINS = ("arithmetic", "grammar", "strings", "python")
Split = Literal["train", "eval"]
_PIECE_CHARS = 1000


class Document(NamedTuple):
    text: str
    domain: str


# Held-out characters of each built-in domain: pretrain's evaluation and analyze_routing's default sample.
EVAL_CHARS_PER_DOMAIN = 20_000


def _arithmetic(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(3, 8)):
        a, b, op = rng.randint(0, 999), rng.randint(0, 999), rng.choice("+-*")
        lines.append(f"{a}{op}{b}={a + b if op == '+' else a - b if op == '-' else a * b}")
    return "\n".join(lines) + "\n"


_GRAMMAR = {
    "S": [["NP", "VP", "."], ["NP", "VP", "and", "NP", "VP", "."]],
    "NP": [["Det", "N"], ["Det", "Adj", "N"], ["Det", "N", "PP"]],
    "VP": [["V", "NP"], ["V"], ["V", "NP", "PP"]],
    "PP": [["P", "Det", "N"]],
    "Det": [["the"], ["a"], ["every"], ["some"]],
    "Adj": [["red"], ["small"], ["quiet"], ["old"], ["bright"]],
    "N": [["robot"], ["cat"], ["hill"], ["river"], ["teacher"], ["garden"], ["lamp"]],
    "V": [["sees"], ["finds"], ["follows"], ["paints"], ["sleeps"], ["likes"]],
    "P": [["near"], ["under"], ["behind"], ["with"]],
}


def _expand(symbol: str, rng: random.Random) -> list[str]:
    if symbol not in _GRAMMAR:
        return [symbol]
    return [word for part in rng.choice(_GRAMMAR[symbol]) for word in _expand(part, rng)]


def _grammar(rng: random.Random) -> str:
    return "\n".join(" ".join(_expand("S", rng)) for _ in range(rng.randint(2, 4))) + "\n"


def _strings(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(2, 5)):
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 12)))
        reverse = rng.random() < 0.5
        lines.append(f"{'reverse' if reverse else 'copy'}: {word} > {word[::-1] if reverse else word}")
    return "\n".join(lines) + "\n"


_GENERATORS = {"arithmetic": _arithmetic, "grammar": _grammar, "strings": _strings}


def standard_library_pieces() -> list[str]:
    """The standard library's top-level ``.py`` files, in name order, cut at line ends into pieces of
    about 1,000 characters."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(folder.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"{folder}: no Python standard library source files (needed by the python domain)")
    pieces = []
    for path in files:
        piece = ""
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
            piece += line
            if len(piece) >= _PIECE_CHARS:
                pieces.append(piece)
                piece = ""
        if piece.strip():
            pieces.append(piece)
    return pieces


def synthetic_documents(split: Split, chars_per_domain: int, seed: int = 0) -> list[Document]:
    """About ``chars_per_domain`` characters of each built-in domain, domain after domain."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} is invalid; allowed: train | eval")
    if chars_per_domain <= 0:
        raise ValueError(f"chars_per_domain={chars_per_domain} is invalid; allowed: a positive number")
    documents = []
    for domain in SYNTHETIC_DOMAINS:
        if domain == "python":
            held_out = split == "eval"
            texts = (p for i, p in enumerate(standard_library_pieces()) if (i % 20 == 19) == held_out)
        else:
            rng = random.Random(f"eqmoe.corpus/{seed}/{split}/{domain}")
            texts = iter(functools.partial(_GENERATORS[domain], rng), None)
        total = 0
        for text in texts:
            documents.append(Document(text, domain))
            total += len(text)
            if total >= chars_per_domain:
                break
    return documents


def load_documents(paths: Sequence[str | Path]) -> list[Document]:
    """Documents from local files (see the module docstring); errors name the file and line."""
    documents = []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: data file not found")
        if path.suffix != ".jsonl":
            try:
                text = path.read_bytes().decode("utf-8-sig")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}: not valid UTF-8 ({error.reason} at byte {error.start})") from None
            if text.strip():
                documents.append(Document(text, path.stem))
            continue
        for record, where in iter_records(path):
            if not isinstance(record.get("text"), str):
                raise ValueError(f'{where}: expected an object with a string "text"')
            domain = record.get("domain", path.stem)
            if not isinstance(domain, str):
                raise ValueError(f'{where}: "domain" must be a string, got {type(domain).__name__}')
            if record["text"].strip():
                documents.append(Document(record["text"], domain))
    if not documents:
        raise ValueError(f"{', '.join(map(str, paths))}: no non-empty document")
    return documents


def split_documents(documents: list[Document], every: int = 20) -> tuple[list[Document], list[Document]]:
    """``(train, held_out)``: every ``every``-th document is held out (at least one, when there are two)."""
    held_out = [d for i, d in enumerate(documents) if i % every == every - 1]
    if not held_out and len(documents) > 1:
        held_out = documents[-1:]
    train = [d for d in documents if all(d is not h for h in held_out)]
    return train, held_out


class PackedDocuments(NamedTuple):
    """Packed rows whose ``Packed.labels`` index ``domains`` (-1 on padding)."""

    packed: Packed
    domains: tuple[str, ...]


def pack_documents(
    documents: Sequence[Document], tokenizer: Tokenizer, seq_len: int, domains: Sequence[str] | None = None
) -> PackedDocuments:
    """Encode each document followed by ``eos_id``, cut it into pieces of at most ``seq_len`` tokens (each
    its own segment, positions restarting) and pack them; every token is a training target.

    ``domains`` fixes the label order (the held-out set must use the training set's); by default the
    domains in order of first appearance.
    """
    domains = tuple(domains) if domains is not None else tuple(dict.fromkeys(d.domain for d in documents))
    index = {name: i for i, name in enumerate(domains)}
    pieces, labels = [], []
    for number, document in enumerate(documents):
        if document.domain not in index:
            raise ValueError(f"document {number}: domain {document.domain!r} is not one of {domains}")
        ids = np.asarray([*tokenizer.encode(document.text), tokenizer.eos_id], np.int32)
        for start in range(0, len(ids), seq_len):
            piece = ids[start : start + seq_len]
            pieces.append((piece, np.ones(len(piece), bool)))
            labels.append(index[document.domain])
    return PackedDocuments(pack(pieces, seq_len, tokenizer.pad_id, labels=labels), domains)
