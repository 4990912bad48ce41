"""Chat data from JSON Lines: one ``{"messages": [{"role": ..., "content": ...}, ...]}`` per line.

The file is read as UTF-8 (a leading byte-order mark is allowed). Blank lines are skipped. Every error is
a ``ValueError`` that starts with ``file:line``: invalid UTF-8, malformed JSON, a line that is not an
object with a ``"messages"`` list, a message without a string ``role``/``content`` or with a role other
than ``system``, ``user`` or ``assistant``. A conversation without an assistant turn has nothing to
train on: it is skipped and counted. A file with no usable conversation is an error naming the file.
"""

import json
from pathlib import Path
from typing import NamedTuple

from eqmoe.data.chat import check_messages


class JsonlData(NamedTuple):
    """The conversations (messages reduced to ``role`` and ``content``) and how many were skipped."""

    conversations: list[list[dict[str, str]]]
    skipped_no_assistant: int


def _parse_line(raw: bytes, where: str) -> object | None:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{where}: not valid UTF-8 ({error.reason} at byte {error.start})") from None
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: malformed JSON ({error.msg} at column {error.colno})") from None


def load_jsonl(path: str | Path) -> JsonlData:
    """Every conversation of the JSONL file at ``path`` that has an assistant turn."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: JSONL file not found")
    conversations: list[list[dict[str, str]]] = []
    skipped = 0
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            record = _parse_line(raw, where)
            if record is None:
                continue
            if not isinstance(record, dict) or "messages" not in record:
                got = f"an object with keys {sorted(record)}" if isinstance(record, dict) else type(record).__name__
                raise ValueError(f'{where}: expected an object with a "messages" list, got {got}')
            check_messages(record["messages"], where=f"{where}: messages")
            messages = [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
            if not any(m["role"] == "assistant" for m in messages):
                skipped += 1
                continue
            conversations.append(messages)
    if not conversations:
        reason = f" ({skipped} without an assistant turn)" if skipped else ""
        raise ValueError(f"{path}: no conversation with an assistant turn{reason}")
    return JsonlData(conversations, skipped)
