"""A ``tiktoken.model`` (the Kimi family's tokenizer: Kimi K2, Moonlight) read and text cut as their
``tokenization_kimi.py`` does; :class:`eqmoe.data.tokenizers.hf.TiktokenTokenizer` encodes with it."""

import base64
import binascii
import itertools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
RESERVED_SPECIALS = 256  # ids after the ranks that are special tokens, named ``<|reserved_token_{id}|>`` if unnamed
_MAX_CHUNK = 400_000  # tokenization_kimi.py encodes text in chunks of this many characters ...
_MAX_RUN = 25_000  # ... and cuts runs of whitespace or of non-whitespace longer than this (tiktoken issue 195)
_LONG_RUN = re.compile(rf"(?<!\S)\S{{{_MAX_RUN + 1},}}|(?<!\s)\s{{{_MAX_RUN + 1},}}")
_SURROGATE = re.compile("[\ud800-\udfff]")


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


def text_pieces(text: str) -> list[str]:
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


def valid_utf8(text: str) -> tuple[str, bytes]:
    """``text`` with any surrogate code point replaced by U+FFFD (the length kept), and its UTF-8 bytes."""
    try:
        return text, text.encode("utf-8")
    except UnicodeEncodeError:
        text = _SURROGATE.sub("\ufffd", text)
        return text, text.encode("utf-8")
