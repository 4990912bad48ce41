"""Chat templates: the model's own Jinja template, rendered as Hugging Face renders it, in a sandbox.

A template comes from a tokenizer folder (``chat_template.jinja``, else ``tokenizer_config.json``'s
``chat_template``: a string, or named templates of which ``tool_use`` is taken for conversations with tools
and ``default`` otherwise), from a file the user names, or is :data:`CHATML`, the built-in one for the byte
tokenizer and for tokenizers without a template.

Rendering follows transformers' ``apply_chat_template``: jinja2's ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks``, loop controls, the ``tojson`` filter without HTML escaping, the globals
``raise_exception``, ``strftime_now``, ``dict`` and an underscore-refusing ``namespace``; the variables are
the messages (keys whose value is ``None`` dropped, reasoning under ``reasoning_content`` and ``thinking``),
``tools``, ``add_generation_prompt``, the tokenizer's named special tokens (``eos_token``, ...) and any
template variables (``enable_thinking``, ...). Templates come from downloaded folders, so nothing they do
can reach Python internals: the sandbox refuses and the error says so.

``{% generation %} ... {% endgeneration %}`` marks the text the assistant produces; :meth:`ChatTemplate.render`
returns those character spans beside the text.
"""

import functools
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

# The built-in template: Qwen's ChatML, with the assistant's text, reasoning, tool calls and closing
# <|im_end|> marked as generated. Tool results go in a ``tool`` turn.
CHATML = """\
{%- macro text(content) %}
    {%- if content is string %}{{- content }}
    {%- elif content %}{%- for part in content %}{{- part.text }}{%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- text(messages[0].content) + '\\n\\n' }}{%- endif %}
    {{- '# Tools\\n\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (tools and loop.first and message.role == 'system') %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.role == 'assistant' %}
            {%- generation %}
                {%- if message.reasoning_content %}
                    {{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}
                {%- endif %}
                {{- text(message.content) }}
                {%- for call in message.tool_calls or [] %}
                    {%- set call = call.function or call %}
                    {%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}
                    {{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
                    {{- call.arguments if call.arguments is string else call.arguments | tojson }}
                    {{- '}\\n</tool_call>' }}
                {%- endfor %}
                {{- '<|im_end|>' }}
            {%- endgeneration %}
            {{- '\\n' }}
        {%- else %}
            {{- text(message.content) + '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters bracketing generated text while rendering


class TemplateError(ValueError):
    """A template that fails to compile or render; the message says why."""


class Rendered(NamedTuple):
    """A rendered conversation and the ``[start, end)`` character spans inside ``{% generation %}`` tags."""

    text: str
    generated: list[tuple[int, int]]


class _Generation(jinja2.ext.Extension):
    """``{% generation %}``: brackets its output with private-use marks, removed after rendering."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
        return _OPEN + caller() + _CLOSE


class _Namespace(jinja2.utils.Namespace):
    """jinja2's ``namespace`` refusing underscore names, which could otherwise shadow its internals."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=64)
def _compile(text: str) -> jinja2.Template:
    """A template compiled once per text: a ChatML template took 28 ms to compile, paid by every tokenizer made."""
    return _environment().from_string(text)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals.update(
        raise_exception=_raise_exception,
        strftime_now=lambda format: datetime.now().strftime(format),
        dict=lambda *args, **kwargs: dict(*args, **kwargs),
        namespace=_Namespace,
    )
    return environment


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as templates see them (as transformers passes them): keys whose value is ``None`` dropped,
    reasoning given as ``thinking`` or ``reasoning`` also under ``reasoning_content`` and ``thinking``."""
    out = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning") if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplate:
    """A compiled chat template with the variables it renders with.

    **Arguments:**

    - ``source``: the Jinja text, or named templates ``{name: text}`` (``default`` and ``tool_use``).
    - ``origin``: where it came from, for messages (a path, or ``"built-in ChatML"``).
    - ``variables``: rendered with every conversation: the tokenizer's named special tokens and template
      variables such as ``enable_thinking``.
    """

    def __init__(self, source: str | Mapping[str, str], origin: str, variables: Mapping[str, Any] | None = None):
        self.origin = origin
        self.variables = dict(variables or {})
        named = {"default": source} if isinstance(source, str) else dict(source)
        self.sources = named
        self._compiled: dict[str, jinja2.Template] = {}
        for name, text in named.items():
            if not isinstance(text, str):
                raise TemplateError(f"{origin}: chat template {name!r} is not text")
            try:
                self._compiled[name] = _compile(text)
            except jinja2.exceptions.TemplateSyntaxError as error:
                why = f"{error} (line {error.lineno})"
                raise TemplateError(f"{origin}: the chat template does not compile: {why}") from None

    def source(self, tools: object = None) -> str:
        """The template text a conversation (with or without ``tools``) renders with."""
        return self.sources[self._name(tools)]

    def _name(self, tools: object) -> str:
        if tools and "tool_use" in self.sources:
            return "tool_use"
        if "default" in self.sources:
            return "default"
        if len(self.sources) == 1:
            return next(iter(self.sources))
        raise TemplateError(f"{self.origin}: named chat templates {sorted(self.sources)} and none is 'default'")

    @property
    def has_generation_tags(self) -> bool:
        """Whether every template marks the assistant's text with ``{% generation %}``."""
        return all(_GENERATION_TAG.search(text) for text in self.sources.values())

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> Rendered:
        """The conversation's text and its ``{% generation %}`` spans; :class:`TemplateError` with the
        template's own message when it raises, or the sandbox's when it reaches for Python internals."""
        context = {
            **self.variables,
            "messages": template_messages(messages),
            "tools": None if tools is None else list(tools),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            marked = self._compiled[self._name(tools)].render(context)
        except jinja2.exceptions.SecurityError as error:
            raise TemplateError(f"{self.origin}: the sandbox refused the template: {error}") from None
        except jinja2.exceptions.TemplateError as error:
            raise TemplateError(f"{self.origin}: the template raised: {error}") from None
        except (TypeError, AttributeError, KeyError, ValueError, IndexError) as error:
            raise TemplateError(f"{self.origin}: the template failed: {type(error).__name__}: {error}") from None
        return _unmark(marked, self.origin)

    def __repr__(self) -> str:
        return f"ChatTemplate({self.origin!r})"


def _unmark(marked: str, origin: str) -> Rendered:
    pieces, spans, length, start = [], [], 0, None
    for piece in re.split(f"([{_OPEN}{_CLOSE}])", marked):
        if piece == _OPEN:
            if start is not None:
                raise TemplateError(f"{origin}: nested {{% generation %}} blocks")
            start = length
        elif piece == _CLOSE:
            if start < length:
                spans.append((start, length))
            start = None
        else:
            pieces.append(piece)
            length += len(piece)
    return Rendered("".join(pieces), spans)


def check_no_marks(text: str, where: str) -> None:
    """``ValueError`` when ``text`` holds the private-use characters rendering reserves."""
    if _OPEN in text or _CLOSE in text:
        raise ValueError(f"{where}: contains U+E000/U+E001, which eqmoe reserves while rendering templates")


def special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens of a ``tokenizer_config.json`` (strings, or ``{"content": ...}`` objects)."""
    found = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            found[name] = value
    return found


def read_template_file(path: str | Path, variables: Mapping[str, Any] | None = None) -> ChatTemplate:
    """A template from a ``.jinja`` file (or a ``tokenizer_config.json`` holding ``chat_template``)."""
    path = Path(path)
    if not path.is_file():
        raise TemplateError(f"{path}: chat template file not found")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        source = _config_template(json.loads(text), path)
        if source is None:
            raise TemplateError(f"{path}: no chat_template in it")
        return ChatTemplate(source, str(path), variables)
    return ChatTemplate(text, str(path), variables)


def _config_template(config: object, path: Path) -> str | dict[str, str] | None:
    source = config.get("chat_template") if isinstance(config, Mapping) else None
    if isinstance(source, list):  # [{"name": ..., "template": ...}]
        try:
            return {entry["name"]: entry["template"] for entry in source}
        except (TypeError, KeyError):
            raise TemplateError(f"{path}: chat_template list entries need 'name' and 'template'") from None
    return source


def folder_template(folder: Path, config: Mapping[str, Any], variables: Mapping[str, Any]) -> ChatTemplate | None:
    """The template a tokenizer folder carries, or ``None``: ``chat_template.jinja`` (with any
    ``additional_chat_templates/NAME.jinja``) first, then ``tokenizer_config.json``'s ``chat_template``."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        named = {"default": jinja.read_text(encoding="utf-8")}
        extra = folder / "additional_chat_templates"
        if extra.is_dir():
            named.update({p.stem: p.read_text(encoding="utf-8") for p in sorted(extra.glob("*.jinja"))})
        return ChatTemplate(named if len(named) > 1 else named["default"], str(jinja), variables)
    source = _config_template(config, folder / "tokenizer_config.json")
    if source is None:
        return None
    return ChatTemplate(source, str(folder / "tokenizer_config.json"), variables)
