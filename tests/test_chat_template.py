"""Chat templates against transformers' apply_chat_template: ids, generation prompts and assistant masks."""

import copy

import pytest
from chat_fixtures import PLAIN_CHAT, TEMPLATES, TOOL_CHAT, write_tokenizer_folder

from eqmoe.data import check_conversation, encode_chat, end_of_turn_ids, load_tokenizer, prompt_ids
from eqmoe.data.template import CHATML

transformers = pytest.importorskip("transformers")

SYSTEMLESS = {"messages": [m for m in TOOL_CHAT["messages"] if m["role"] != "system"], "tools": None}
CHATS = {"tools": TOOL_CHAT, "plain": PLAIN_CHAT, "systemless": SYSTEMLESS}
TEMPLATE_TEXT = {
    "reasoner": (TEMPLATES / "reasoner.jinja").read_text(),
    "tagged": (TEMPLATES / "tagged.jinja").read_text(),
    "chatml": CHATML,
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: write_tokenizer_folder(root / name, text) for name, text in TEMPLATE_TEXT.items()}


def _trained_pieces(tokenizer, ids, mask):
    pieces, current = [], []
    for token, trained in zip(ids.tolist(), mask.tolist(), strict=True):
        if trained:
            current.append(token)
        elif current:
            pieces.append(tokenizer.decode(current))
            current = []
    return pieces + ([tokenizer.decode(current)] if current else [])


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("template", sorted(TEMPLATE_TEXT))
def test_ids_prompt_and_mask_equal_transformers(folders, template, chat, thinking):
    variables = {} if thinking is None else {"enable_thinking": thinking}
    reference = transformers.AutoTokenizer.from_pretrained(folders[template])
    ours = load_tokenizer(folders[template], template_vars=variables)
    messages, tools = CHATS[chat]["messages"], CHATS[chat].get("tools")
    tagged = template != "reasoner"
    expected = reference.apply_chat_template(
        copy.deepcopy(messages), tools=tools, return_dict=True, return_assistant_tokens_mask=tagged, **variables
    )
    ids, mask = encode_chat(check_conversation(messages, tools), ours)
    assert ids.tolist() == list(expected["input_ids"])
    if tagged:
        assert mask.astype(int).tolist() == list(expected["assistant_masks"])
    prompt = prompt_ids(check_conversation(messages[:-1], tools), ours)
    expected_prompt = reference.apply_chat_template(
        copy.deepcopy(messages[:-1]), tools=tools, add_generation_prompt=True, return_dict=False, **variables
    )
    assert prompt.tolist() == list(expected_prompt)


def test_reasoner_mask_is_every_assistant_token_and_nothing_else(folders):
    """The common-prefix rule on a template that drops earlier reasoning: the trained text is exactly what the
    whole render holds of each assistant turn (reasoning only on the last), headers and prompts untrained."""
    tokenizer = load_tokenizer(folders["reasoner"])
    ids, mask = encode_chat(check_conversation(TOOL_CHAT["messages"], TOOL_CHAT["tools"]), tokenizer)
    assert _trained_pieces(tokenizer, ids, mask) == [
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is 21 degrees in Paris.<|im_end|>",
        "<think>\nNo forecast tool.\n</think>\n\nI cannot tell tomorrow's.<|im_end|>",
    ]
    untrained = tokenizer.decode(ids[~mask])
    for message in TOOL_CHAT["messages"]:
        if message["role"] != "assistant" and isinstance(message["content"], str):
            assert message["content"] in untrained
    assert untrained.count("<|im_start|>assistant\n") == 3


def test_generation_prompt_tokens_are_not_trained(folders):
    """With enable_thinking=false the prompt holds an empty think block: a reply rendered with one trains only
    what follows it."""
    tokenizer = load_tokenizer(folders["reasoner"], template_vars={"enable_thinking": False})
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    ids, mask = encode_chat(check_conversation(messages), tokenizer)
    assert _trained_pieces(tokenizer, ids, mask) == ["Hello.<|im_end|>"]
    assert tokenizer.decode(ids[~mask]).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n\n"
    )  # + the turn's newline
    with_thinking = load_tokenizer(folders["reasoner"], template_vars={"enable_thinking": True})
    ids, mask = encode_chat(check_conversation(messages), with_thinking)
    assert _trained_pieces(with_thinking, ids, mask) == ["<think>\n\n</think>\n\nHello.<|im_end|>"]


def test_end_of_turn_and_generation_config_stop_ids(folders, tmp_path):
    folder = write_tokenizer_folder(tmp_path / "tok", TEMPLATE_TEXT["tagged"])
    (folder / "generation_config.json").write_text('{"eos_token_id": [0, 6]}')
    tokenizer = load_tokenizer(folder)
    eot = tokenizer.token_to_id("<|eot_id|>")
    assert end_of_turn_ids(tokenizer) == (eot, 0)
    assert end_of_turn_ids(load_tokenizer(folders["reasoner"]))[0] == tokenizer.token_to_id("<|im_end|>")


def test_chat_template_jinja_file_and_cli_file_take_precedence(folders, tmp_path):
    folder = write_tokenizer_folder(tmp_path / "tok", TEMPLATE_TEXT["reasoner"])
    (folder / "chat_template.jinja").write_text(TEMPLATE_TEXT["tagged"])
    assert load_tokenizer(folder).chat_template.origin.endswith("chat_template.jinja")
    named = load_tokenizer(folder, chat_template=TEMPLATES / "reasoner.jinja").chat_template
    assert named.origin.endswith("reasoner.jinja") and not named.has_generation_tags
    plain = write_tokenizer_folder(tmp_path / "plain")
    assert load_tokenizer(plain).chat_template.origin == "built-in ChatML"


BAD_TEMPLATES = {
    "raises": ("{{ raise_exception('this model needs a system turn') }}", "this model needs a system turn"),
    "internals": ("{{ ''.__class__.__mro__ }}", "sandbox refused"),
    "dunder namespace": ("{% set ns = namespace(_x=1) %}", "sandbox refused"),
    "drops assistant": (
        "{% for m in messages %}{% if m.role != 'assistant' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "cannot be found",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_TEMPLATES))
def test_bad_templates_fail_with_the_reason(tmp_path, case):
    template, message = BAD_TEMPLATES[case]
    tokenizer = load_tokenizer(write_tokenizer_folder(tmp_path / "tok", template))
    with pytest.raises(ValueError, match=message):
        encode_chat(check_conversation(PLAIN_CHAT["messages"]), tokenizer)


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        (
            [{"role": "bot", "content": "x"}],
            r"\[0\]\.role='bot' is invalid; allowed: system \| user \| assistant \| tool",
        ),
        ([{"role": "user"}], r"\[0\]: missing 'content'"),
        (
            [{"role": "user", "content": [{"type": "image", "url": "x"}]}],
            r"content\[0\]: a 'image' part is not supported",
        ),
        ([{"role": "user", "content": [{"type": "audio_clip", "url": "x"}]}], "expected a text part"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "only assistant messages have tool_calls"),
        ([{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}], "tool_calls\\[0\\]"),
        ([], "the conversation is empty"),
    ],
)
def test_bad_messages_name_the_message(messages, message):
    with pytest.raises(ValueError, match=message):
        check_conversation(messages)
