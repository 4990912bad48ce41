"""Conversations: their schema, their token ids under the tokenizer's chat template, and the loss mask.

A conversation is a list of messages (roles ``system``, ``user``, ``assistant``, ``tool``; ``content`` a
string or a list of ``{"type": "text", "text": ...}`` parts; an assistant's ``tool_calls`` and
``reasoning_content``) and an optional list of ``tools`` (JSON schemas).

The ids are the tokens of the template's single render of the whole conversation, as transformers'
``apply_chat_template(tokenize=True)`` gives them. The loss mask comes from that same render: it is true on
every token the assistant produces (its text, reasoning, tool calls and the end-of-turn token) and false on
everything else (system, user and tool turns, role headers, what the generation prompt already holds):

- a template with ``{% generation %}`` tags marks those spans itself (transformers'
  ``return_assistant_tokens_mask``);
- otherwise each assistant turn starts where the render of the conversation before it, followed by the
  generation prompt, stops matching the whole render (the common-prefix rule), and ends with the first
  end-of-turn token after that. When a template rewrites history (Qwen3 drops the reasoning of turns before
  the last user message), the render before a turn is not a prefix of the whole render; the turn is then
  found after the previous one by the generation prompt's header, so the mask covers exactly what the whole
  render holds of each turn. A turn that cannot be found is an error saying why.

A token is trained when its characters overlap a trained span (transformers' rule).
"""

import json
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any, NamedTuple

import numpy as np
from jaxtyping import Bool, Int32, Int64

from eqmoe.data.template import TemplateError, check_no_marks
from eqmoe.data.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")


class Conversation(NamedTuple):
    """Checked messages (``None`` values dropped) and the conversation's tools."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None

    @property
    def has_reply(self) -> bool:
        """Whether an assistant turn (something to train on) is in it."""
        return any(m["role"] == "assistant" for m in self.messages)


def message_text(content: object) -> str:
    """The text of a message's content: the string, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or "" for part in content or ())


def _check_content(content: object, where: str) -> None:
    if isinstance(content, str):
        return check_no_marks(content, where)
    if not isinstance(content, list | tuple):
        raise ValueError(f"{where}: must be a string or a list of text parts, got {type(content).__name__}")
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f'{where}[{j}]: expected a text part {{"type": "text", "text": ...}}, got {part!r}')
        check_no_marks(part["text"], f"{where}[{j}].text")


def _check_tool_calls(calls: object, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list | tuple):
        raise ValueError(f"{where}: must be a list of tool calls, got {type(calls).__name__}")
    checked = []
    for j, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f'{where}[{j}]: expected {{"type": "function", "function": {{"name", "arguments"}}}}')
        arguments = function.get("arguments", {})
        if not isinstance(arguments, str | Mapping):
            raise ValueError(f"{where}[{j}].arguments must be an object or a JSON string")
        checked.append(_drop_none(call))
    return checked


def _drop_none(value: Mapping[str, Any]) -> dict[str, Any]:
    return {key: item for key, item in value.items() if item is not None}


def check_conversation(messages: object, tools: object = None, where: str = "messages") -> Conversation:
    """The :class:`Conversation`, or ``ValueError`` naming ``where`` and what is wrong."""
    if not isinstance(messages, list | tuple):
        raise ValueError(f"{where}: expected a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ValueError(f"{where}: the conversation is empty")
    checked = []
    for i, message in enumerate(messages):
        at = f"{where}[{i}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{at}: expected an object with 'role' and 'content', got {message!r}")
        message = _drop_none(message)
        if "role" not in message:
            raise ValueError(f"{at}: missing 'role'")
        if message["role"] not in ROLES:
            raise ValueError(f"{at}.role={message['role']!r} is invalid; allowed: {' | '.join(ROLES)}")
        if "tool_calls" in message:
            if message["role"] != "assistant":
                raise ValueError(f"{at}: only assistant messages have tool_calls")
            message["tool_calls"] = _check_tool_calls(message["tool_calls"], f"{at}.tool_calls")
        if "content" in message:
            _check_content(message["content"], f"{at}.content")
        elif "tool_calls" not in message:
            raise ValueError(f"{at}: missing 'content'")
        reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"{at}.reasoning_content must be a string, got {type(reasoning).__name__}")
        checked.append(message)
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: tools is not valid JSON ({error.msg})") from None
    if tools is not None and (not isinstance(tools, list | tuple) or not all(isinstance(t, Mapping) for t in tools)):
        raise ValueError(f"{where}: tools must be a list of JSON schemas (objects)")
    return Conversation(checked, None if not tools else [dict(t) for t in tools])


def as_conversation(value: object) -> Conversation:
    """A :class:`Conversation` from one, or from a plain list of messages."""
    if isinstance(value, Conversation):
        return value
    return check_conversation(value)


# --- rendering and the mask --------------------------------------------------------------------------


@cache
def _end_of_turn(tokenizer: Tokenizer) -> tuple[str, ...]:
    """The special token(s) the template closes an assistant turn with, found by rendering a probe."""
    probes = (
        [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}],
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "ping"},
            {"role": "assistant", "content": "pong"},
        ],
    )
    for probe in probes:
        try:
            text = tokenizer.chat_template.render(probe).text
        except TemplateError:
            continue
        after = text.rfind("pong") + len("pong")
        ids, offsets = tokenizer.encode_with_offsets([text])[0]
        for token, (start, _) in zip(ids.tolist(), offsets.tolist(), strict=True):
            if start >= after and token in tokenizer.special_ids:
                return (tokenizer.special_ids[token],)
    eos = getattr(tokenizer, "special_tokens", {}).get("eos_token")
    return (eos,) if eos else ()


def end_of_turn_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids generation stops on: the template's end-of-turn token and the tokenizer's ``stop_ids``."""
    ids = [tokenizer.token_to_id(token) for token in _end_of_turn(tokenizer)]
    return tuple(dict.fromkeys([i for i in ids if i is not None] + list(tokenizer.stop_ids)))


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if a[:mid] == b[:mid] else (low, mid)
    return low


def _turn_spans(conversation: Conversation, tokenizer: Tokenizer, text: str) -> list[tuple[int, int]]:
    """The common-prefix rule (see the module docstring): each assistant turn's ``[start, end)`` in ``text``."""
    template, tools = tokenizer.chat_template, conversation.tools
    ends = _end_of_turn(tokenizer)
    if not ends:
        raise ValueError(
            f"{template.origin}: the template closes assistant turns with no special token, so its turns cannot be "
            "found in the render; mark them with {% generation %} tags"
        )
    spans, cursor = [], 0
    for i, message in enumerate(conversation.messages):
        if message["role"] != "assistant":
            continue
        before = template.render(conversation.messages[:i], tools=tools).text
        prompt = template.render(conversation.messages[:i], tools=tools, add_generation_prompt=True).text
        if not prompt.startswith(before):
            raise ValueError(f"message {i}: the generation prompt does not extend the conversation before it")
        header = prompt[len(before) :]
        if text.startswith(before) and len(before) >= cursor:
            base = len(before)
        else:  # history rewritten: find the header after the previous turn
            line = header[: header.index("\n") + 1] if "\n" in header else header
            base = text.find(line, cursor) if line else -1
            if base < 0:
                raise ValueError(
                    f"message {i}: cannot find where this assistant turn starts in the render "
                    f"(no {line!r} after character {cursor})"
                )
        start = base + _common_prefix(header, text[base:])
        found = [(text.find(end, start), end) for end in ends]
        found = [(at, end) for at, end in found if at >= 0]
        if not found:
            raise ValueError(
                f"message {i}: no end-of-turn token {' or '.join(map(repr, ends))} after this assistant turn"
            )
        at, end = min(found)
        stop = at + len(end)
        lines = [line.strip() for line in message_text(message.get("content")).split("</think>")[-1].splitlines()]
        last = next((line for line in reversed(lines) if line), "")
        if last and last not in text[start:stop]:
            raise ValueError(
                f"message {i}: the assistant's text {last!r} is not where the template's turns put it "
                f"(characters {start}..{stop} of the render), so its turns cannot be found"
            )
        spans.append((start, stop))
        cursor = stop
    return spans


def _token_mask(offsets: Int64[np.ndarray, "n 2"], spans: Sequence[tuple[int, int]]) -> Bool[np.ndarray, "n"]:
    mask = np.zeros(len(offsets), bool)
    for start, stop in spans:
        mask |= (offsets[:, 1] > start) & (offsets[:, 0] < stop)
    return mask


class Encoded(NamedTuple):
    """A conversation's ids, loss mask and rendered text."""

    ids: Int32[np.ndarray, "n"]
    loss_mask: Bool[np.ndarray, "n"]
    text: str


def encode_chats(
    conversations: Sequence[object], tokenizer: Tokenizer, where: Sequence[str] | None = None
) -> list[Encoded]:
    """:func:`encode_chat` of each conversation, tokenized in one batch; an error starts with the failing
    conversation's ``where`` (e.g. ``file:line``), by default its index."""
    where = [f"conversation {i}" for i in range(len(conversations))] if where is None else where
    template = tokenizer.chat_template
    texts, all_spans = [], []
    for i, conversation in enumerate(conversations):
        try:
            conversation = as_conversation(conversation)
            rendered = template.render(conversation.messages, tools=conversation.tools)
            if template.has_generation_tags:
                spans = rendered.generated
                if not spans and any(m["role"] == "assistant" for m in conversation.messages):
                    raise ValueError("the template's {% generation %} tags mark none of the assistant's text")
            else:
                spans = _turn_spans(conversation, tokenizer, rendered.text)
        except ValueError as error:
            raise ValueError(f"{where[i]}: {error}") from None
        texts.append(rendered.text)
        all_spans.append(spans)
    encoded = []
    for text, spans, (ids, offsets) in zip(texts, all_spans, tokenizer.encode_with_offsets(texts), strict=True):
        encoded.append(Encoded(ids, _token_mask(offsets, spans), text))
    return encoded


def encode_chat(conversation: object, tokenizer: Tokenizer) -> tuple[Int32[np.ndarray, "n"], Bool[np.ndarray, "n"]]:
    """``(ids, loss_mask)`` of a conversation (a :class:`Conversation` or a list of messages) under the
    tokenizer's chat template: the template's ids and the mask on the assistant's tokens."""
    encoded = encode_chats([conversation], tokenizer)[0]
    return encoded.ids, encoded.loss_mask


def render(conversation: object, tokenizer: Tokenizer, add_generation_prompt: bool = False) -> str:
    """The conversation as the tokenizer's template renders it."""
    conversation = as_conversation(conversation)
    return tokenizer.chat_template.render(
        conversation.messages, tools=conversation.tools, add_generation_prompt=add_generation_prompt
    ).text


def prompt_ids(conversation: object, tokenizer: Tokenizer) -> Int32[np.ndarray, "n"]:
    """The ids of the conversation before a reply (it must not end with an assistant turn) followed by the
    template's generation prompt: ``apply_chat_template(add_generation_prompt=True)``."""
    conversation = as_conversation(conversation)
    if conversation.messages[-1]["role"] == "assistant":
        raise ValueError(
            "prompt_ids: the last message is the assistant's; pass the conversation without the final reply"
        )
    text = render(conversation, tokenizer, add_generation_prompt=True)
    return tokenizer.encode_with_offsets([text])[0][0]
