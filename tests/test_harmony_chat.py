"""SFT in gpt-oss's harmony format: ids against transformers' apply_chat_template, the loss mask against a rule
written here from the special tokens, inspect_data's view and the tokens generation stops on.

tests/templates/gpt_oss.jinja is openai/gpt-oss-20b's published ``chat_template.jinja``, byte for byte: the Hugging
Face repository's commit cbf31f62664d4b1360b3a78427f7b3c3ed8f0fa8 ("Update chat_template.jinja (#94)", 2025-08-08,
its last change of the template), taken from the GitHub mirror of that repository's history EchoCog/gpt-oss-20b
(path chat_template.jinja). It is the same file as ggml-org/llama.cpp's models/templates/openai-gpt-oss-120b.jinja
(llama.cpp copies it unmodified from the Hub; 20b and 120b share it). Before it: 2025-08-04 closed tool calls
with <|end|>, 08-05 kept every tool call's analysis, 08-07 (#82) put a blank line before a tool list that has no
developer instructions above it.
"""

import copy
import hashlib
import json

import pytest
import tyro
from chat_fixtures import HARMONY_STOPS, TEMPLATES, TOOLS, write_harmony_tokenizer_folder

from eqmoe.data import check_conversation, encode_chat, end_of_turn_ids, load_tokenizer, prompt_ids
from experiments import generate, inspect_data

transformers = pytest.importorskip("transformers")

TEMPLATE = TEMPLATES / "gpt_oss.jinja"
PUBLISHED_SHA256 = "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146"


def _call(city: str, as_text: bool = False) -> dict:
    arguments = {"city": city}
    return {
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(arguments) if as_text else arguments},
    }


def _weather(city: str, temp: int) -> dict:
    return {"role": "tool", "content": json.dumps({"city": city, "temp": temp})}


CHATS = {
    "reasoning in the last turn": {
        "messages": [
            {"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "thinking": "Add them: 5.", "content": "5"},
        ]
    },
    "reasoning in earlier turns": {
        "messages": [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "thinking": "Paris, obviously.", "content": "Paris"},
            {"role": "user", "content": "And of Peru?"},
            {"role": "assistant", "thinking": "Lima.", "content": "Lima"},
            {"role": "user", "content": "Of Norway?"},
            {"role": "assistant", "content": "Oslo"},
        ]
    },
    "tool calls with responses": {
        "messages": [
            {"role": "developer", "content": "Use the tools; be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "thinking": "I should call the tool.", "tool_calls": [_call("Paris")]},
            _weather("Paris", 21),
            {"role": "assistant", "thinking": "The tool says 21.", "content": "21 degrees in Paris."},
            {"role": "user", "content": "And Lima, then Oslo?"},
            {"role": "assistant", "content": "Lima first.", "tool_calls": [_call("Lima", as_text=True)]},
            _weather("Lima", 18),
            {"role": "assistant", "thinking": "Now Oslo.", "tool_calls": [_call("Oslo")]},
            _weather("Oslo", 9),
            {"role": "assistant", "thinking": "18 and 9.", "content": "Lima 18, Oslo 9."},
        ],
        "tools": TOOLS,
    },
    "tool call last": {  # no final answer follows: the call's analysis stays in the render
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "thinking": "Call it.", "tool_calls": [_call("Oslo")]},
        ],
        "tools": TOOLS,
    },
    "the same call again": {  # the first call's analysis is dropped, the second's kept: same text after it
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "thinking": "Ask the tool.", "tool_calls": [_call("Oslo")]},
            _weather("Oslo", 9),
            {"role": "assistant", "content": "9 degrees."},
            {"role": "user", "content": "Check again?"},
            {"role": "assistant", "thinking": "Ask the tool.", "tool_calls": [_call("Oslo")]},
            _weather("Oslo", 9),
        ],
        "tools": TOOLS,
    },
    "ends with a tool response": {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Weather in Lima?"},
            {"role": "assistant", "content": "Asking the tool.", "tool_calls": [_call("Lima")]},
            _weather("Lima", 18),
        ],
        "tools": TOOLS,
    },
}
# (variables for eqmoe's tokenizer, the same as apply_chat_template keyword arguments)
VARIABLES = {
    "default": {},
    "low": {"reasoning_effort": "low"},
    "high": {"reasoning_effort": "high", "model_identity": "You are a weather bot."},
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_harmony_tokenizer_folder(tmp_path_factory.mktemp("harmony") / "gpt-oss", TEMPLATE.read_text())


@pytest.fixture(scope="module")
def reference(folder):
    return transformers.AutoTokenizer.from_pretrained(folder)


def test_the_template_is_the_published_one():
    assert hashlib.sha256(TEMPLATE.read_bytes()).hexdigest() == PUBLISHED_SHA256


# --- ids: transformers' apply_chat_template -----------------------------------------------------------------


@pytest.mark.parametrize("effort", sorted(VARIABLES))
@pytest.mark.parametrize("chat", sorted(CHATS))
def test_ids_and_prompts_equal_transformers(folder, reference, chat, effort):
    variables = VARIABLES[effort]
    ours = load_tokenizer(folder, template_vars=variables)
    messages, tools = CHATS[chat]["messages"], CHATS[chat].get("tools")
    expected = reference.apply_chat_template(copy.deepcopy(messages), tools=tools, return_dict=False, **variables)
    ids, _ = encode_chat(check_conversation(messages, tools), ours)
    assert ids.tolist() == list(expected)
    if "reasoning_effort" in variables:
        assert f"Reasoning: {variables['reasoning_effort']}" in ours.decode(ids)
    for last, message in enumerate(messages):  # the prompt before every reply
        if message["role"] == "assistant":
            prompt = prompt_ids(check_conversation(messages[:last], tools), ours)
            expected = reference.apply_chat_template(
                copy.deepcopy(messages[:last]), tools=tools, add_generation_prompt=True, return_dict=False, **variables
            )
            assert prompt.tolist() == list(expected)


# --- the loss mask: a rule written from the special tokens, apart from eqmoe's ----------------------------


def expected_mask(reference, ids: list[int]) -> list[bool]:
    """Harmony messages are ``<|start|>HEADER<|channel|>...<|message|>BODY`` closed by ``<|end|>``, ``<|return|>``
    or ``<|call|>``; HEADER starts with the author (``assistant``, ``user``, ``functions.NAME``, ...). A turn is a
    run of assistant messages; everything after its first ``<|start|>assistant`` up to its last closer is trained."""
    start = reference.convert_tokens_to_ids("<|start|>")
    closers = set(reference.convert_tokens_to_ids(["<|end|>", "<|return|>", "<|call|>"]))
    messages = []  # (index of <|start|>, index of its closer, author)
    for i, token in enumerate(ids):
        if token == start:
            close = next(j for j in range(i, len(ids)) if ids[j] in closers)
            header = reference.decode(ids[i + 1 : close]).split("<|", 1)[0]
            messages.append((i, close, header.split(" ", 1)[0]))
    mask = [False] * len(ids)
    for k, (first, _, author) in enumerate(messages):
        if author != "assistant" or (k and messages[k - 1][2] == "assistant"):
            continue  # not an assistant's, or not the first message of its turn
        last = k
        while last + 1 < len(messages) and messages[last + 1][2] == "assistant":
            last += 1
        after = first + 1  # past the tokens of the role word
        while reference.decode(ids[first + 1 : after]) != "assistant":
            after += 1
        closer = messages[last][1]
        mask[after : closer + 1] = [True] * (closer + 1 - after)
    return mask


@pytest.mark.parametrize("effort", ["default", "high"])
@pytest.mark.parametrize("chat", sorted(CHATS))
def test_mask_trains_each_reply_from_after_its_prompt_through_its_closer(folder, reference, chat, effort):
    ours = load_tokenizer(folder, template_vars=VARIABLES[effort])
    ids, mask = encode_chat(check_conversation(CHATS[chat]["messages"], CHATS[chat].get("tools")), ours)
    assert mask.tolist() == expected_mask(reference, ids.tolist())


def _trained_pieces(tokenizer, ids, mask) -> list[str]:
    pieces, current = [], []
    for token, trained in zip(ids.tolist(), mask.tolist(), strict=True):
        if trained:
            current.append(token)
        elif current:
            pieces.append(tokenizer.decode(current))
            current = []
    return pieces + ([tokenizer.decode(current)] if current else [])


def test_trained_text_of_a_tool_using_conversation(folder):
    """Earlier reasoning and the analysis of calls answered later are dropped by the template, so untrained; the
    channel headers, the ``<|start|>assistant`` inside a turn and every closer are trained; nothing of the system,
    developer, user or tool messages is."""
    tokenizer = load_tokenizer(folder)
    chat = CHATS["tool calls with responses"]
    ids, mask = encode_chat(check_conversation(chat["messages"], chat["tools"]), tokenizer)
    call = ' to=functions.get_weather<|channel|>commentary json<|message|>{{"city": "{}"}}<|call|>'
    assert _trained_pieces(tokenizer, ids, mask) == [
        call.format("Paris"),
        "<|channel|>final<|message|>21 degrees in Paris.<|end|>",
        ' to=functions.get_weather<|channel|>commentary json<|message|>"{\\"city\\": \\"Lima\\"}"<|call|>',
        call.format("Oslo"),
        "<|channel|>analysis<|message|>18 and 9.<|end|><|start|>assistant<|channel|>final<|message|>"
        "Lima 18, Oslo 9.<|return|>",
    ]
    untrained = tokenizer.decode(ids[~mask])
    assert untrained.count("<|start|>assistant") == 5 and "<|start|>functions.get_weather to=assistant" in untrained
    for text in ("Use the tools; be brief.", "Weather in Paris?", '\\"temp\\": 21', "Reasoning: medium"):
        assert text in untrained


# --- inspect_data -------------------------------------------------------------------------------------------


def test_inspect_data_shows_the_trained_spans_with_reasoning_effort(folder, tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(CHATS[name]) + "\n" for name in ("tool calls with responses", "tool call last")))
    argv = ["--tokenizer", str(folder), "--data", str(data), "--template-var", "reasoning_effort=high", "--limit", "2"]
    assert inspect_data.main(tyro.cli(inspect_data.Args, args=argv)) == 0
    out = capsys.readouterr().out
    assert "Reasoning: high" in out and "[[<|channel|>final<|message|>21 degrees in Paris.<|end|>]]" in out
    assert (
        "<|start|>assistant[[<|channel|>analysis<|message|>18 and 9.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Lima 18, Oslo 9.<|return|>]]" in out
    )
    assert (
        "<|start|>assistant[[<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant to=functions."
        'get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>]]' in out
    )
    assert "[[" not in out.split("<|start|>user", 1)[0]  # system and developer messages untrained
    assert 'with reasoning_effort="high"' in out and "2 conversations" in out


# --- generation stops ---------------------------------------------------------------------------------------


def test_generation_stops_on_return_and_call_never_on_end(folder, tmp_path):
    tokenizer = load_tokenizer(folder)
    ids = {token: tokenizer.token_to_id(token) for token in ("<|return|>", "<|call|>", "<|endoftext|>", "<|end|>")}
    assert end_of_turn_ids(tokenizer) == (ids["<|return|>"], ids["<|call|>"], ids["<|endoftext|>"])
    # the template alone gives both (a folder whose generation_config.json lists <|return|> and <|endoftext|> only)
    bare = write_harmony_tokenizer_folder(tmp_path / "bare", TEMPLATE.read_text())
    (bare / "generation_config.json").unlink()
    assert end_of_turn_ids(load_tokenizer(bare)) == (ids["<|return|>"], ids["<|call|>"])

    stops = generate.stop_ids(generate.Args(chat=True), folder, tokenizer)
    assert sorted(stops) == sorted(ids[token] for token in HARMONY_STOPS) and ids["<|end|>"] not in stops
    assert generate.stop_ids(generate.Args(), folder, tokenizer) == [ids[token] for token in HARMONY_STOPS]
    for reply in (
        "<|channel|>analysis<|message|>Add.<|end|><|start|>assistant<|channel|>final<|message|>5<|return|>",
        "<|channel|>analysis<|message|>Ask.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary "
        'json<|message|>{"city": "Oslo"}<|call|>',
    ):
        new = tokenizer.encode(reply)
        assert next(i for i, token in enumerate(new) if token in stops) == len(new) - 1  # the whole reply
