"""Conversations: their schema, their token ids under the tokenizer's chat template, and the loss mask.

A conversation is a list of messages (roles ``system``, ``developer``, ``user``, ``assistant``, ``tool``;
``content`` a string or a list of ``{"type": "text", "text": ...}`` parts; an assistant's ``tool_calls`` and
reasoning, as ``reasoning_content`` or ``thinking``) and an optional list of ``tools`` (JSON schemas).

The ids are the tokens of the template's single render of the whole conversation, as transformers'
``apply_chat_template(tokenize=True)`` gives them. The loss mask comes from that same render: it is true on
every token the assistant produces (its text, reasoning, tool calls and the end-of-turn token) and false on
everything else (system, user and tool turns, role headers, what the generation prompt already holds):

- a template with ``{% generation %}`` tags marks those spans itself (transformers'
  ``return_assistant_tokens_mask``);
- otherwise each assistant turn runs from the end of the generation prompt to the special token closing the
  turn's last message, both found by rendering prefixes of the conversation (:mod:`eqmoe.data.turns`), so the
  mask covers exactly what the whole render holds of each turn, also where the template rewrites history (Qwen3
  and gpt-oss drop earlier reasoning). A turn that cannot be found is an error saying why.

A token is trained when its characters overlap a trained span (transformers' rule).
"""

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from jaxtyping import Bool, Int32, Int64

from eqmoe.data.template import check_no_marks
from eqmoe.data.tokenizer import Tokenizer
from eqmoe.data.turns import end_of_turn_ids, turn_spans  # noqa: F401 (end_of_turn_ids: part of the chat API)

ROLES = ("system", "user", "assistant", "tool", "developer")  # developer: harmony's (gpt-oss) instructions


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


_MEDIA = ("image", "image_url", "video", "video_url", "audio", "input_audio")


def _check_content(content: object, where: str) -> None:
    if isinstance(content, str):
        return check_no_marks(content, where)
    if not isinstance(content, list | tuple):
        raise ValueError(f"{where}: must be a string or a list of text parts, got {type(content).__name__}")
    for j, part in enumerate(content):
        if isinstance(part, Mapping) and part.get("type") in _MEDIA:
            raise ValueError(
                f"{where}[{j}]: a {part['type']!r} part is not supported; eqmoe's models read text only (a multimodal "
                "checkpoint's language model), allowed: text parts"
            )
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
        for key in ("reasoning_content", "thinking", "reasoning"):  # the names templates read reasoning under
            if key in message:
                if not isinstance(message[key], str):
                    raise ValueError(f"{at}.{key} must be a string, got {type(message[key]).__name__}")
                check_no_marks(message[key], f"{at}.{key}")
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
                spans = turn_spans(conversation.messages, conversation.tools, tokenizer, rendered.text)
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
