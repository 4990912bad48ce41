"""The ChatML template (Qwen's): token ids and the assistant loss mask of a conversation.

Each message is rendered as ``<|im_start|>{role}\\n{content}<|im_end|>\\n``. The loss mask of
:func:`encode_chat` is true exactly on the tokens of assistant content and on the ``<|im_end|>`` that
closes each assistant turn, so the model learns both the answer and when to stop; the role header and
the newline after ``<|im_end|>`` are never trained on. Template pieces and contents are encoded
separately, so a special token spelled out in a byte-tokenized message stays plain text.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jaxtyping import Bool, Int32

from eqmoe.data.tokenizer import IM_END, IM_START, Tokenizer

ROLES = ("system", "user", "assistant")
Conversation = Sequence[Mapping[str, Any]]


def check_messages(messages: object, where: str = "messages") -> None:
    """``ValueError`` naming ``where`` and what is wrong unless ``messages`` is a non-empty list of
    ``{"role": "system" | "user" | "assistant", "content": str}`` (other keys are ignored)."""
    if not isinstance(messages, list | tuple):
        raise ValueError(f"{where}: expected a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ValueError(f"{where}: the conversation is empty")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"{where}[{i}]: expected an object with 'role' and 'content', got {message!r}")
        if "role" not in message or "content" not in message:
            missing = [key for key in ("role", "content") if key not in message]
            raise ValueError(f"{where}[{i}]: missing {' and '.join(repr(k) for k in missing)}")
        if message["role"] not in ROLES:
            raise ValueError(f"{where}[{i}].role={message['role']!r} is invalid; allowed: {' | '.join(ROLES)}")
        if not isinstance(message["content"], str):
            content = message["content"]
            raise ValueError(f"{where}[{i}].content must be a string, got {type(content).__name__}: {content!r}")


def render(messages: Conversation, add_generation_prompt: bool = False) -> str:
    """The conversation as template text (what :func:`encode_chat` tokenizes), for display."""
    check_messages(messages)
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def encode_chat(messages: Conversation, tokenizer: Tokenizer) -> tuple[Int32[np.ndarray, "n"], Bool[np.ndarray, "n"]]:
    """``(ids, loss_mask)``: the template's token ids and the mask that is true exactly on assistant
    content tokens and the ``<|im_end|>`` closing each assistant turn."""
    check_messages(messages)
    ids: list[int] = []
    mask: list[bool] = []
    newline = tokenizer.encode("\n")
    for message in messages:
        trained = message["role"] == "assistant"
        head = [tokenizer.im_start_id, *tokenizer.encode(message["role"] + "\n")]
        body = tokenizer.encode(message["content"])
        ids += head + body + [tokenizer.im_end_id] + newline
        mask += [False] * len(head) + [trained] * (len(body) + 1) + [False] * len(newline)
    return np.asarray(ids, np.int32), np.asarray(mask, bool)


def prompt_ids(messages: Conversation, tokenizer: Tokenizer) -> Int32[np.ndarray, "n"]:
    """The ids of ``messages`` (the conversation before the reply, not ending with an assistant turn)
    followed by ``<|im_start|>assistant\\n``: the prefix to generate the reply from."""
    check_messages(messages)
    if messages[-1]["role"] == "assistant":
        raise ValueError(
            "prompt_ids: the last message is the assistant's; pass the conversation without the final reply"
        )
    ids, _ = encode_chat(messages, tokenizer)
    tail = [tokenizer.im_start_id, *tokenizer.encode("assistant\n")]
    return np.concatenate([ids, np.asarray(tail, np.int32)])
