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
  ``<|start|>assistant<|channel|>final<|message|>`` after it and the final ``<|return|>`` or ``<|call|>``. A
  template may close no reply with a token of its own: GLM-4.5's model stops by writing the next message's role
  token (``<|user|>``, ``<|observation|>``), so that token ends the span, and the conversation's last reply runs to
  the end of the render. Any other turn with more than whitespace after its last special token needs
  ``{% generation %}`` tags.
- what the turn must hold (its first tool call's name, else the last line of its reply) is looked for in it, unless
  the template renders none of it even for the conversation's last message: DeepSeek-V3's renders a tool call only
  when the message's content is null, and a reply with empty content and a call renders as
  ``<｜Assistant｜><｜end▁of▁sentence｜>``, its turn then being that.

A turn that cannot be found is an error saying why.
"""

import re
import warnings
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any, NamedTuple

from eqmoe.data.template import ChatTemplate, TemplateError
from eqmoe.data.tokenizer import Tokenizer

# Replies ending with "pong", each rendered as a conversation's last message, and which special token after "pong"
# closes it: a message's first (<|im_end|>, harmony's <|return|>); a tool call's last, since a call may hold special
# tokens of its own (DeepSeek-V3's <｜tool▁call▁end｜>) before the one that ends the reply (harmony's <|call|>).
_CALL = {"type": "function", "function": {"name": "probe", "arguments": {"text": "pong"}}}
_PROBES = (({"role": "assistant", "content": "pong"}, 0), ({"role": "assistant", "tool_calls": [_CALL]}, -1))
_OPENINGS = ([], [{"role": "system", "content": "s"}])  # some templates need a system message
# What follows each probe reply when the conversation goes on: a user message after an answer, a result after a call.
_FOLLOWING = ({"role": "user", "content": "ping"}, {"role": "tool", "content": "pang"})


def _specials_after(tokenizer: Tokenizer, text: str, after: int) -> list[str]:
    ids, offsets = tokenizer.encode_with_offsets([text])[0]
    pairs = zip(ids.tolist(), offsets[:, 0].tolist(), strict=True)
    return [tokenizer.special_ids[token] for token, start in pairs if start >= after and token in tokenizer.special_ids]


def _opener_after(tokenizer: Tokenizer, text: str, chat: list[dict]) -> str | None:
    """The special token the render of ``chat`` goes on with right after ``text`` (whitespace aside), if any."""
    special = _special_pattern(tokenizer)
    try:
        more = tokenizer.chat_template.render(chat).text
    except TemplateError:
        return None
    rest = more[len(text) :]
    opener = None if special is None or not more.startswith(text) else special.match(rest.lstrip())
    return None if opener is None else opener.group(0)


class _Ends(NamedTuple):
    """What ends a reply: the special tokens, and whether they open the next message (the template closing no
    reply itself)."""

    tokens: tuple[str, ...]
    by_next_message: bool


@cache
def _reply_ends(tokenizer: Tokenizer) -> _Ends:
    """The special tokens that end a reply: those the template ends the conversation's last reply with, a
    message's (``<|im_end|>``, harmony's ``<|return|>``) and a tool call's where it differs (harmony's ``<|call|>``),
    never a token that closes only part of a reply (harmony's ``<|end|>`` after the analysis); for a template that
    renders none after the last reply, those the next message opens with (GLM-4.5's ``<|user|>`` after an answer,
    ``<|observation|>`` after a call)."""
    found, by_next = [], False
    for (reply, which), following in zip(_PROBES, _FOLLOWING, strict=True):
        for opening in _OPENINGS:
            chat = [*opening, {"role": "user", "content": "ping"}, reply]
            try:
                text = tokenizer.chat_template.render(chat).text
            except TemplateError:
                continue
            specials = _specials_after(tokenizer, text, text.rfind("pong") + len("pong"))
            opener = None if specials else _opener_after(tokenizer, text, [*chat, following])
            if specials or opener:
                found.append(specials[which] if specials else opener)
                by_next = by_next or opener is not None
                break
    if not found:
        eos = getattr(tokenizer, "special_tokens", {}).get("eos_token")
        found = [eos] if eos else []
    return _Ends(tuple(dict.fromkeys(found)), by_next)


def end_of_turn_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids generation stops on: the tokens that end a reply and the tokenizer's ``stop_ids``."""
    ids = [tokenizer.token_to_id(token) for token in _reply_ends(tokenizer).tokens]
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
        self._done: dict[tuple[int, bool], str] = {}

    def __call__(self, upto: int, prompt: bool = False) -> str:
        if (upto, prompt) not in self._done:
            rendered = self.template.render(self.messages[:upto], tools=self.tools, add_generation_prompt=prompt)
            self._done[upto, prompt] = rendered.text
        return self._done[upto, prompt]

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


def _turn_stop(i: int, text: str, start: int, end: int, special: re.Pattern | None, tokenizer: Tokenizer) -> int:
    """Where turn ``i``'s trained text stops: after its last special token, when only whitespace follows it up to
    the next message (at ``end``); else after the special token the next message opens with, which the model
    writes to end its turn (GLM-4.5's ``<|user|>``, ``<|observation|>``), or at the render's end for the
    conversation's last reply under a template that closes no reply itself."""
    closing = None if special is None else next(reversed(list(special.finditer(text, start, end))), None)
    if closing is not None and not text[closing.end() : end].strip():
        return closing.end()
    if special is not None and _reply_ends(tokenizer).by_next_message:
        rest = text[end:]
        opener = special.match(text, end + len(rest) - len(rest.lstrip()))
        if opener is not None or end == len(text):
            return end if opener is None else opener.end()
    raise ValueError(
        f"{tokenizer.chat_template.origin}: message {i}: the template closes this assistant turn with no special "
        f"token ({text[start:end][-40:]!r}), so its turns cannot be found in the render; mark them with "
        "{% generation %} tags"
    )


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
        if landmark and renders(i + 1).count(landmark) <= renders(i).count(landmark):
            landmark = ""  # the template renders none of it, even as the last message (DeepSeek-V3's empty call)
            if message.get("tool_calls"):  # one text per template, so that the warning is shown once
                warnings.warn(
                    f"{template.origin}: the template renders no tool call of an assistant message, so those calls "
                    "are not trained (DeepSeek-V3's renders a call only beside a null content, which transformers "
                    "drops before rendering)",
                    stacklevel=2,
                )
        end = _turn_end(i, renders, text, start, header, landmark, special)
        stop = _turn_stop(i, text, start, end, special, tokenizer)
        if landmark and landmark not in text[start:stop]:
            raise ValueError(
                f"message {i}: the assistant's text {landmark!r} is not where the template's turns put it "
                f"(characters {start}..{stop} of the render), so its turns cannot be found"
            )
        spans.append((start, stop))
        cursor = stop
    return spans
