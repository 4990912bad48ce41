"""Tokenizer folders and conversations shared by the chat-template tests."""

import json
from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"
SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

TOOL_CHAT = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should call the tool.",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21 degrees in Paris.", "reasoning_content": "The tool says 21."},
        {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "tomorrow?"}]},
        {"role": "assistant", "content": "I cannot tell tomorrow's.", "reasoning_content": "No forecast tool."},
    ],
    "tools": TOOLS,
}

PLAIN_CHAT = {
    "messages": [
        {"role": "user", "content": "Reverse: abc"},
        {"role": "assistant", "content": "cba"},
        {"role": "user", "content": "Sort: 3 1 2"},
        {"role": "assistant", "content": "<think>\nsmall first\n</think>\n\n1 2 3"},
    ]
}


def write_tokenizer_folder(folder: Path, template: str | None = None, **config) -> Path:
    """A byte-level BPE tokenizer folder that transformers' AutoTokenizer and eqmoe both read."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [json.dumps(TOOL_CHAT), json.dumps(PLAIN_CHAT), "the weather in Paris is 21 degrees"] * 4
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=SPECIAL
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_tokens(ADDED)
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        **config,
    }
    if template is not None:
        settings["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder


def write_chat_model_folder(folder: Path, template: str) -> Path:
    """A tiny transformers-saved Qwen3-MoE folder with its own BPE tokenizer (its vocabulary the model's), chat
    template and generation settings whose stop id is not the template's end of turn."""
    from tokenizers import Tokenizer

    from tests.conftest import save_tiny_hf

    write_tokenizer_folder(folder, template)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    save_tiny_hf(folder, vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), num_hidden_layers=2)
    generation = {
        "bos_token_id": tokenizer.token_to_id("<|begin_of_text|>"),
        "eos_token_id": tokenizer.token_to_id("<|endoftext|>"),
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
    }
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


# gpt-oss's harmony format: its special tokens (o200k_harmony's, in id order) and the stop ids its
# generation_config.json lists (<|return|>, <|endoftext|>, <|call|>: 200002, 199999, 200012 in the real vocabulary).
HARMONY_SPECIAL = [
    "<|startoftext|>",
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
]
HARMONY_STOPS = ["<|return|>", "<|endoftext|>", "<|call|>"]


def write_harmony_tokenizer_folder(folder: Path, template: str) -> Path:
    """A byte-level BPE folder laid out as openai/gpt-oss-20b's: harmony special tokens, ``chat_template.jinja``,
    ``tokenizer_config.json`` naming ``<|return|>`` as eos, and ``generation_config.json``'s stop ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [json.dumps(TOOL_CHAT), template, "analysis commentary final functions assistant developer"] * 4
    trainer = trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=HARMONY_SPECIAL
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    stops = [tokenizer.token_to_id(token) for token in HARMONY_STOPS]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return folder
