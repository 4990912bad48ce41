"""The published chat templates of the families eqmoe fine-tunes, tokenizer folders laid out as their Hub
repositories', and a tool-using conversation for each as the template expects it.

The templates in tests/templates are stored byte for byte (their SHA-256 below; gpt-oss's is
tests/test_harmony_chat.py's):

- ``qwen3.jinja``: Qwen/Qwen3-30B-A3B's ``tokenizer_config.json`` ``chat_template`` (the Qwen3 hybrid-thinking
  template, the one with ``message.content is string``), as huggingface/trl keeps it in
  ``trl/chat_templates/qwen3.jinja`` to recognise Qwen3 checkpoints by equality (its tests match it against
  tiny-Qwen3MoeForCausalLM, made from Qwen/Qwen3-30B-A3B's tokenizer).
- ``qwen3_coder.jinja``: Qwen/Qwen3-Coder-30B-A3B-Instruct's template, as the GGUF of ollama's ``qwen3-coder:30b``
  carries it (listed in huggingface/huggingface.js ``packages/ollama-utils/src/chat-template-automap.ts``); the
  same text, but for the final newline, as the swift-jinja tests' ``qwen3_coder``.
- ``deepseek_v3.jinja``: deepseek-ai/DeepSeek-V3's ``chat_template`` (the one with ``is_first_sp``): ollama's
  ``deepseek-v3:671b`` GGUF (the same automap file) and a public model list giving it for
  huggingface.co/deepseek-ai/DeepSeek-V3 hold it identically. It renders a tool call only when the message's
  ``content`` is null, and transformers drops null values before rendering (the template then fails on the
  missing content): a call with ``content: ""`` renders as an empty reply.
- ``glm4_5.jinja``: zai-org/GLM-4.5's ``chat_template.jinja``, as huggingface/trl keeps it in
  ``trl/chat_templates/glm4moe.jinja`` (its tiny-Glm4MoeForCausalLM is made from zai-org/GLM-4.5's tokenizer).
  GLM-4.5-Air's was not at hand to compare.
- ``kimi_k2_thinking.jinja``: moonshotai/Kimi-K2-Thinking's ``chat_template.jinja``, as the tests of
  huggingface/huggingface.js's Jinja engine (``packages/jinja/test/e2e.test.js``) render it: the Kimi K2 template
  with reasoning. (Kimi-K2-Instruct's own has no reasoning; no verbatim copy of it could be had offline.)

A tokenizer folder is a small byte-level BPE trained here with the family's added tokens: role and end tokens
special, tool and reasoning tags plain added tokens (as servers' tool-call parsers need them in decoded text).
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"

SHA256 = {
    "qwen3.jinja": "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8",
    "qwen3_coder.jinja": "672e747c77e990320152343b0a4951222e40de5645297905d89afba05586d827",
    "deepseek_v3.jinja": "3b8267e54b67df6500f231ffa969955cc9d26b3444a291ced4eb96ca7d3ca1ea",
    "glm4_5.jinja": "44f815868bf02fa458dd2f741a338046f4bf45f398eb6d067766726b9d96cce3",
    "kimi_k2_thinking.jinja": "3b0ed4adbd8b6693d8435a87e844c701d7c27abe0229150cca55488c8df1c7ad",
}

QWEN_ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
DEEPSEEK_ADDED = tuple(
    f"<｜{name}｜>"
    for name in (
        "User", "Assistant", "tool▁calls▁begin", "tool▁calls▁end", "tool▁call▁begin", "tool▁call▁end", "tool▁sep",
        "tool▁outputs▁begin", "tool▁outputs▁end", "tool▁output▁begin", "tool▁output▁end",
    )
)  # fmt: skip
GLM_SPECIAL = ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
GLM_ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>") + tuple(
    f"<{end}{name}>" for name in ("arg_key", "arg_value") for end in ("", "/")
)
KIMI_SPECIAL = ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")
KIMI_ADDED = ("<think>", "</think>") + tuple(
    f"<|{name}|>"
    for name in (
        "tool_calls_section_begin", "tool_calls_section_end", "tool_call_begin", "tool_call_argument_begin",
        "tool_call_end",
    )
)  # fmt: skip


@dataclass(frozen=True)
class Family:
    """A published template and the tokenizer folder it ships in."""

    template: str
    special: tuple[str, ...]  # added tokens marked special
    added: tuple[str, ...]  # added tokens that are not
    settings: dict  # tokenizer_config.json's named special tokens
    stops: tuple[str, ...] = ()  # generation_config.json's eos_token_id
    variables: tuple[dict, ...] = field(default_factory=lambda: ({},))  # template variables rendered with


FAMILIES = {
    "qwen3": Family(
        "qwen3.jinja",
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        QWEN_ADDED,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        variables=({}, {"enable_thinking": False}),
    ),
    "qwen3-coder": Family(
        "qwen3_coder.jinja",
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        QWEN_ADDED,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    ),
    "deepseek-v3": Family(
        "deepseek_v3.jinja",
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
        DEEPSEEK_ADDED,
        dict(bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>", pad_token="<｜end▁of▁sentence｜>"),
    ),
    "glm-4.5": Family(
        "glm4_5.jinja",
        GLM_SPECIAL,
        GLM_ADDED,
        {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
        stops=("<|endoftext|>", "<|user|>", "<|observation|>"),
        variables=({}, {"enable_thinking": False}),
    ),
    "kimi-k2": Family(
        "kimi_k2_thinking.jinja",
        KIMI_SPECIAL,
        KIMI_ADDED,
        {"bos_token": "[BOS]", "eos_token": "<|im_end|>", "pad_token": "[EOS]"},
    ),
}


def _call(name: str, arguments: dict, as_text: bool, call_id: str | None = None) -> dict:
    function = {"name": name, "arguments": json.dumps(arguments) if as_text else arguments}
    return {"type": "function", "function": function, **({} if call_id is None else {"id": call_id})}


def _reply(content: str, reasoning: str, *calls: dict) -> dict:
    return {
        "role": "assistant",
        "content": content,
        "reasoning_content": reasoning,
        **({"tool_calls": list(calls)} if calls else {}),
    }


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def tool_chat(family: str) -> dict:
    """A conversation with reasoning, tool calls, their results and answers, in the form the family's template
    reads: arguments as JSON text where it concatenates them (DeepSeek-V3), as objects where it iterates them
    (Qwen3-Coder, GLM-4.5); call ids where it prints them (Kimi K2)."""
    as_text = family == "deepseek-v3"
    ids = family == "kimi-k2"

    def call(city: str, n: int) -> dict:
        return _call("get_weather", {"city": city}, as_text, f"functions.get_weather:{n}" if ids else None)

    def result(city: str, temp: int, n: int) -> dict:
        message = {"role": "tool", "content": json.dumps({"city": city, "temp": temp})}
        return {**message, "tool_call_id": f"functions.get_weather:{n}"} if ids else message

    messages = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris?"},
        _reply("", "I should call the tool.", call("Paris", 0)),
        result("Paris", 21, 0),
        _reply("It is 21 degrees in Paris.", "The tool says 21."),
        {"role": "user", "content": "And Lima?"},
        _reply("Asking.", "Call again.", call("Lima", 1)),
        result("Lima", 18, 1),
        _reply("18 degrees in Lima.", "It says 18."),
        {"role": "user", "content": "And Oslo?"},
        _reply("", "Once more.", call("Oslo", 2)),
        result("Oslo", 9, 2),  # ending on a call keeps its reasoning in Kimi K2's render, which drops earlier turns'
    ]
    return {"messages": messages, "tools": [WEATHER_TOOL]}


# deepseek-ai/DeepSeek-V3's template with a tool call as a user writes it for it: the reply's content empty, the
# arguments JSON text. The template renders no call then: the reply is <｜Assistant｜><｜end▁of▁sentence｜>.
DEEPSEEK_ADD = {
    "messages": [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("add", {"a": 2, "b": 3}, as_text=True)]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "2 plus 3 is 5."},
    ]
}


def write_family_folder(folder: Path, family: str) -> Path:
    """A tokenizer folder as the family's Hub repository lays it out: ``tokenizer.json`` (a byte-level BPE with its
    added tokens), ``tokenizer_config.json``, ``chat_template.jinja`` and, where it has one, the
    ``generation_config.json`` stop ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    spec = FAMILIES[family]
    template = (TEMPLATES / spec.template).read_text(encoding="utf-8")
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [json.dumps(tool_chat(family)), json.dumps(DEEPSEEK_ADD), template] * 4
    trainer = trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=list(spec.special)
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in spec.added])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", **spec.settings}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, ensure_ascii=False), encoding="utf-8")
    if spec.stops:
        stops = [tokenizer.token_to_id(token) for token in spec.stops]
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return folder
