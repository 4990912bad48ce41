"""Where the assistant's turns lie in a template's render, for templates without ``{% generation %}`` tags, and
the tokens that end a reply (generation stops on them).

A turn is found by rendering prefixes of the conversation and comparing each with the render of the whole, so no
template needs a rule of its own:

- it **starts** where the render of the conversation before it, followed by the generation prompt, stops matching
  the whole render (the common-prefix rule). When the template rewrites history (Qwen3 drops the reasoning of
  turns before the last user message, gpt-oss the analysis of a tool call once a final answer follows), that render
  is not a prefix of the whole; the turn then starts after the generation prompt's header, found after the
  previous turn.
- it **ends** where the next message begins: where the render of the conversation up to and including the turn,
  *as history*, stops. A template may render the last reply unlike earlier ones (gpt-oss keeps its reasoning and
  closes it with ``<|return|>`` instead of ``<|end|>``), so the history is rendered with the generation prompt,
  which makes the turn an earlier one, and the prompt cut off again. When that render is not a prefix of the
  whole (history rewritten again), the turn ends where the history's tail from the reply's last line (or its
  tool call's name) on is first found after the turn's start. The conversation's last message ends with the
  render.
- the span is cut back to the end of its last special token, so what separates messages (ChatML's newline) is
  not trained, while all of one turn's messages are: gpt-oss's analysis ``<|end|>``, the
  ``<|start|>assistant<|channel|>final<|message|>`` after it and the final ``<|return|>`` or ``<|call|>``. More
  than whitespace after that token means the template closes turns with no special token of its own; such a
  template needs ``{% generation %}`` tags.

A turn that cannot be found is an error saying why.
"""

import re
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from eqmoe.data.template import ChatTemplate, TemplateError
from eqmoe.data.tokenizer import Tokenizer

# Replies ending with "pong", each rendered as a conversation's last message, and which special token after "pong"
# closes it: a message's first (<|im_end|>, harmony's <|return|>); a tool call's last, since a call may hold special
# tokens of its own (DeepSeek-V3's <｜tool▁call▁end｜>) before the one that ends the reply (harmony's <|call|>).
_CALL = {"type": "function", "function": {"name": "probe", "arguments": {"text": "pong"}}}
_PROBES = (({"role": "assistant", "content": "pong"}, 0), ({"role": "assistant", "tool_calls": [_CALL]}, -1))
_OPENINGS = ([], [{"role": "system", "content": "s"}])  # some templates need a system message


def _specials_after(tokenizer: Tokenizer, text: str, after: int) -> list[str]:
    ids, offsets = tokenizer.encode_with_offsets([text])[0]
    pairs = zip(ids.tolist(), offsets[:, 0].tolist(), strict=True)
    return [tokenizer.special_ids[token] for token, start in pairs if start >= after and token in tokenizer.special_ids]


@cache
def _reply_ends(tokenizer: Tokenizer) -> tuple[str, ...]:
    """The special tokens the template ends the conversation's last reply with: a message's (``<|im_end|>``,
    harmony's ``<|return|>``) and a tool call's where it differs (harmony's ``<|call|>``). Never a token that
    closes only part of a reply (harmony's ``<|end|>`` after the analysis)."""
    found = []
    for reply, which in _PROBES:
        for opening in _OPENINGS:
            try:
                text = tokenizer.chat_template.render([*opening, {"role": "user", "content": "ping"}, reply]).text
            except TemplateError:
                continue
            specials = _specials_after(tokenizer, text, text.rfind("pong") + len("pong"))
            if specials:
                found.append(specials[which])
                break
    if not found:
        eos = getattr(tokenizer, "special_tokens", {}).get("eos_token")
        found = [eos] if eos else []
    return tuple(dict.fromkeys(found))


def end_of_turn_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids generation stops on: the tokens the template ends a reply with and the tokenizer's ``stop_ids``."""
    ids = [tokenizer.token_to_id(token) for token in _reply_ends(tokenizer)]
    return tuple(dict.fromkeys([i for i in ids if i is not None] + list(tokenizer.stop_ids)))


@cache
def _special_pattern(tokenizer: Tokenizer) -> re.Pattern | None:
    specials = sorted(set(tokenizer.special_ids.values()), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, specials))) if specials else None


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if a[:mid] == b[:mid] else (low, mid)
    return low


def _landmark(message: Mapping[str, Any]) -> str:
    """What the turn must hold: its first tool call's name (a template may drop the text beside a call, and
    harmony renders one call only), else the last line of the reply after any ``</think>``."""
    for call in message.get("tool_calls") or ():
        return call.get("function", call)["name"]
    content = message.get("content")
    text = content if isinstance(content, str) else "".join(p.get("text") or "" for p in content or ())
    lines = [line.strip() for line in text.split("</think>")[-1].splitlines()]
    return next((line for line in reversed(lines) if line), "")


class _Renders:
    """The template's renders of one conversation's prefixes."""

    def __init__(self, template: ChatTemplate, messages: Sequence[Mapping[str, Any]], tools):
        self.template, self.messages, self.tools = template, messages, tools

    def __call__(self, upto: int, prompt: bool = False) -> str:
        return self.template.render(self.messages[:upto], tools=self.tools, add_generation_prompt=prompt).text

    def history(self, upto: int, header: str) -> str:
        """``messages[:upto]`` rendered as a conversation that goes on: with the generation prompt, cut off."""
        try:
            text = self(upto, prompt=True)
        except TemplateError:
            return self(upto)
        return text[: -len(header)] if header and text.endswith(header) else self(upto)


def _turn_start(i: int, renders: _Renders, text: str, cursor: int) -> tuple[int, str]:
    """Where turn ``i``'s own text starts (after the generation prompt) and the prompt's header."""
    before, prompt = renders(i), renders(i, prompt=True)
    if not prompt.startswith(before):
        raise ValueError(f"message {i}: the generation prompt does not extend the conversation before it")
    header = prompt[len(before) :]
    if text.startswith(before) and len(before) >= cursor:
        base = len(before)
    else:  # history rewritten: the header after the previous turn
        line = header[: header.index("\n") + 1] if "\n" in header else header
        base = text.find(line, cursor) if line else -1
        if base < 0:
            raise ValueError(
                f"message {i}: cannot find where this assistant turn starts in the render "
                f"(no {line!r} after character {cursor})"
            )
    return base + _common_prefix(header, text[base:]), header


def _turn_end(
    i: int, renders: _Renders, text: str, start: int, header: str, landmark: str, special: re.Pattern | None
) -> int:
    """Where the message after turn ``i`` begins in ``text`` (its end when the turn is the last message)."""
    if i == len(renders.messages) - 1:
        return len(text)
    history = renders.history(i + 1, header)
    if text.startswith(history) and len(history) > start:
        return len(history)
    # History rewritten: the history's tail from the reply's last words (or its closing token) on is found first
    # in this turn, whatever the template changed before them. Later turns cannot match first.
    last_special = None if special is None else next(reversed(list(special.finditer(history))), None)
    at = history.rfind(landmark) if landmark else -1 if last_special is None else last_special.start()
    found = -1 if at < 0 else text.find(history[at:], start)
    if found < 0:
        raise ValueError(
            f"message {i}: the render holds no {history[at:] if at >= 0 else landmark!r} after this assistant turn's "
            "start, as the template ends the turn when the conversation goes on, so its end cannot be found"
        )
    return found + len(history) - at


def turn_spans(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, tokenizer: Tokenizer, text: str
) -> list[tuple[int, int]]:
    """Each assistant turn's ``[start, end)`` character span in ``text``, the render of the whole conversation."""
    template, special = tokenizer.chat_template, _special_pattern(tokenizer)
    renders = _Renders(template, messages, tools)
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, header = _turn_start(i, renders, text, cursor)
        landmark = _landmark(message)
        end = _turn_end(i, renders, text, start, header, landmark, special)
        closing = None if special is None else next(reversed(list(special.finditer(text, start, end))), None)
        if closing is None or text[closing.end() : end].strip():
            raise ValueError(
                f"{template.origin}: message {i}: the template closes this assistant turn with no special token "
                f"({text[start:end][-40:]!r}), so its turns cannot be found in the render; mark them with "
                "{% generation %} tags"
            )
        stop = closing.end()
        if landmark and landmark not in text[start:stop]:
            raise ValueError(
                f"message {i}: the assistant's text {landmark!r} is not where the template's turns put it "
                f"(characters {start}..{stop} of the render), so its turns cannot be found"
            )
        spans.append((start, stop))
        cursor = stop
    return spans
