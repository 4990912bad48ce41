"""Conversation layouts of data files: OpenAI-style ``messages``, ShareGPT, and prompt/completion.

The layout is detected from a file's first record and every record must follow it:

- ``messages``: ``{"messages": [{"role", "content", ...}], "tools": [...]?}`` (the schema of
  :mod:`eqmoe.data.chat`);
- ``sharegpt``: ``{"conversations": [{"from", "value"}], "system"?, "tools"?}``; ``from`` is ``human``/``user``,
  ``gpt``/``assistant``/``model``, ``system``, ``function_call`` (an assistant tool call, its value the call's
  JSON) or ``observation``/``tool``/``function`` (a tool result);
- ``prompt_completion``: ``{"prompt", "completion"}``, each a string (a user turn, an assistant turn) or a
  list of messages.

``field`` names the key holding the messages or ShareGPT turns when it is not the usual one (in a ``.json``
object, it names the list of records instead: see :mod:`eqmoe.data.records`).
"""

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

from eqmoe.data.chat import Conversation, check_conversation
from eqmoe.data.records import iter_records

LAYOUTS = ("messages", "sharegpt", "prompt_completion")
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "observation": "tool",
    "tool": "tool",
    "function": "tool",
    "function_response": "tool",
}


def _turns_layout(turns: object) -> str | None:
    first = turns[0] if isinstance(turns, list) and turns else None
    if isinstance(first, Mapping) and "from" in first and "value" in first:
        return "sharegpt"
    if isinstance(first, Mapping) and "role" in first:
        return "messages"
    return None


def detect_layout(record: Mapping, field: str | None = None) -> tuple[str, str]:
    """``(layout, key)`` of a record: the layout and the key holding its turns (``prompt`` for prompt/completion)."""
    if field is not None and field in record:  # else the field named a .json file's list of records
        layout = _turns_layout(record[field])
        if layout is None:
            raise ValueError(f"field {field!r} is not a list of messages or of ShareGPT turns")
        return layout, field
    for key in ("messages", "conversations", "conversation"):
        if key in record and record[key] is not None:
            layout = _turns_layout(record[key])
            if layout is not None:
                return layout, key
    if "prompt" in record and "completion" in record:
        return "prompt_completion", "prompt"
    raise ValueError(
        f"cannot tell the layout from the fields {', '.join(sorted(record))}; expected 'messages', "
        "'conversations' (ShareGPT) or 'prompt' + 'completion' (or name the field with --data-field)"
    )


def _sharegpt(record: Mapping, key: str, where: str) -> Conversation:
    turns = record[key]
    if not isinstance(turns, list):
        raise ValueError(f"{where}: {key} must be a list of turns")
    messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping) or "from" not in turn or "value" not in turn:
            raise ValueError(f'{where}: {key}[{i}]: expected {{"from", "value"}}, got {turn!r}')
        source, value = turn["from"], turn["value"]
        if source == "function_call":
            try:
                call = json.loads(value) if isinstance(value, str) else value
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: {key}[{i}]: function_call is not JSON ({error.msg})") from None
            messages.append({"role": "assistant", "tool_calls": [{"type": "function", "function": call}]})
        elif source in _SHAREGPT_ROLES:
            messages.append({"role": _SHAREGPT_ROLES[source], "content": value})
        else:
            allowed = " | ".join([*_SHAREGPT_ROLES, "function_call"])
            raise ValueError(f"{where}: {key}[{i}].from={source!r} is invalid; allowed: {allowed}")
    return check_conversation(messages, record.get("tools"), where=f"{where}: {key}")


def _prompt_completion(record: Mapping, where: str) -> Conversation:
    messages = []
    for key, role in (("prompt", "user"), ("completion", "assistant")):
        value = record[key]
        if isinstance(value, str):
            messages.append({"role": role, "content": value})
        elif isinstance(value, list):
            messages.extend(value)
        else:
            raise ValueError(f"{where}: {key} must be a string or a list of messages, got {type(value).__name__}")
    return check_conversation(messages, record.get("tools"), where=where)


def to_conversation(record: object, layout: str, key: str, where: str) -> Conversation:
    """The record as a checked :class:`~eqmoe.data.chat.Conversation`; ``ValueError`` starting with ``where``."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected an object, got {type(record).__name__}")
    if layout == "prompt_completion":
        if "prompt" not in record or "completion" not in record:
            raise ValueError(f"{where}: missing 'prompt' or 'completion' (the file's layout is prompt_completion)")
        return _prompt_completion(record, where)
    if key not in record or record[key] is None:
        raise ValueError(f"{where}: missing {key!r} (the file's layout is {layout})")
    if layout == "sharegpt":
        return _sharegpt(record, key, where)
    return check_conversation(record[key], record.get("tools"), where=f"{where}: {key}")


class Item(NamedTuple):
    """One record of a file: its conversation and location."""

    conversation: Conversation | None
    where: str


class ConversationFile(NamedTuple):
    """A data file's layout (detected from its first record) and its conversations, lazily."""

    layout: str
    items: Iterator[Item]


def read_conversations(path: str | Path, *, field: str | None = None, split: str | None = None) -> ConversationFile:
    """The conversations of a data file (see :mod:`eqmoe.data.records` for the file formats), streamed."""
    records = iter_records(path, field=field, split=split)
    first = next(records, None)
    if first is None:
        raise ValueError(f"{path}: no records")
    try:
        layout, key = detect_layout(first.record, field)
    except ValueError as error:
        raise ValueError(f"{first.where}: {error}") from None

    def items() -> Iterator[Item]:
        for record in _chain(first, records):
            yield Item(to_conversation(record.record, layout, key, record.where), record.where)

    return ConversationFile(layout, items())


def _chain(first, rest):
    yield first
    yield from rest


class Loaded(NamedTuple):
    """A whole file's conversations with an assistant turn, its layout and how many records had none."""

    conversations: list[Conversation]
    layout: str
    skipped_no_assistant: int


def load_conversations(path: str | Path, *, field: str | None = None, split: str | None = None) -> Loaded:
    """Every conversation of a data file in memory (for small files; :mod:`eqmoe.data.tokenized` streams)."""
    data = read_conversations(path, field=field, split=split)
    conversations, skipped = [], 0
    for item in data.items:
        if item.conversation.has_reply:
            conversations.append(item.conversation)
        else:
            skipped += 1
    if not conversations:
        why = f" ({skipped} without an assistant turn)" if skipped else ""
        raise ValueError(f"{path}: no conversation with an assistant turn{why}")
    return Loaded(conversations, data.layout, skipped)
