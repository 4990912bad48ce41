"""The published chat templates of Qwen3, Qwen3-Coder, DeepSeek-V3, GLM-4.5 and Kimi K2 on conversations with
reasoning, tool calls and their results: ids and generation prompts against transformers' apply_chat_template, the
loss mask against each format's own rule for where the assistant writes, written here from its special tokens.
gpt-oss's harmony template is tests/test_harmony_chat.py's."""

import copy
import hashlib
import json

import pytest
from published_templates import DEEPSEEK_ADD, FAMILIES, SHA256, TEMPLATES, tool_chat, write_family_folder

from eqmoe.data import check_conversation, encode_chat, end_of_turn_ids, load_tokenizer, prompt_ids
from experiments import inspect_data

transformers = pytest.importorskip("transformers")

# Where each format's assistant writes: from right after a marker (the generation prompt: a role header, or
# DeepSeek-V3's <｜tool▁outputs▁end｜> after tool results) through the token that ends its reply. GLM-4.5 closes no
# reply itself: the model stops by writing the next message's role token; its last reply runs to the end.
RULES = {
    "qwen3": (("<|im_start|>assistant\n",), ("<|im_end|>",)),
    "qwen3-coder": (("<|im_start|>assistant\n",), ("<|im_end|>",)),
    "deepseek-v3": (("<｜Assistant｜>", "<｜tool▁outputs▁end｜>"), ("<｜end▁of▁sentence｜>",)),
    "glm-4.5": (("<|assistant|>",), ("<|user|>", "<|observation|>", "<|system|>")),
    "kimi-k2": (("<|im_assistant|>assistant<|im_middle|>",), ("<|im_end|>",)),
}


def expected_mask(reference, ids: list[int], family: str) -> list[bool]:
    starts, closers = RULES[family]
    pieces = [reference.decode([token]) for token in ids]
    ends = [sum(len(p) for p in pieces[: i + 1]) for i in range(len(pieces))]
    text = "".join(pieces)
    mask = [False] * len(ids)
    for marker in starts:
        at = text.find(marker)
        while at >= 0:
            assert at + len(marker) in [0, *ends], f"{marker!r} ends inside a token"
            first = ends.index(at + len(marker)) + 1 if at + len(marker) else 0
            last = next((j for j in range(first, len(ids)) if pieces[j] in closers), None)
            assert last is not None or family == "glm-4.5" or first == len(ids), f"{family}: a reply never ends"
            last = len(ids) - 1 if last is None else last
            mask[first : last + 1] = [True] * (last + 1 - first)
            at = text.find(marker, at + 1)
    return mask


def _trained_pieces(tokenizer, ids, mask) -> list[str]:
    pieces, current = [], []
    for token, trained in zip(ids.tolist(), mask.tolist(), strict=True):
        if trained:
            current.append(token)
        elif current:
            pieces.append(tokenizer.decode(current))
            current = []
    return pieces + ([tokenizer.decode(current)] if current else [])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    return {family: write_family_folder(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def references(folders):
    return {family: transformers.AutoTokenizer.from_pretrained(folder) for family, folder in folders.items()}


@pytest.mark.parametrize("name", sorted(SHA256))
def test_the_templates_are_the_published_ones(name):
    assert hashlib.sha256((TEMPLATES / name).read_bytes()).hexdigest() == SHA256[name]


CASES = [(family, i) for family, spec in FAMILIES.items() for i in range(len(spec.variables))]


@pytest.mark.parametrize(("family", "variables"), CASES, ids=[f"{f}-{i}" for f, i in CASES])
def test_ids_and_prompts_equal_transformers(folders, references, family, variables):
    variables = FAMILIES[family].variables[variables]
    ours, reference = load_tokenizer(folders[family], template_vars=variables), references[family]
    chat = tool_chat(family)
    messages, tools = chat["messages"], chat["tools"]
    expected = reference.apply_chat_template(copy.deepcopy(messages), tools=tools, return_dict=False, **variables)
    ids, mask = encode_chat(check_conversation(messages, tools), ours)
    assert ids.tolist() == list(expected) and mask.sum() > 0
    for last, message in enumerate(messages):  # the prompt before every reply
        if message["role"] == "assistant":
            prompt = prompt_ids(check_conversation(messages[:last], tools), ours)
            expected = reference.apply_chat_template(
                copy.deepcopy(messages[:last]), tools=tools, add_generation_prompt=True, return_dict=False, **variables
            )
            assert prompt.tolist() == list(expected), (family, last)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_mask_trains_exactly_what_the_assistant_writes(folders, references, family):
    chat = tool_chat(family)
    ids, mask = encode_chat(check_conversation(chat["messages"], chat["tools"]), load_tokenizer(folders[family]))
    assert mask.tolist() == expected_mask(references[family], ids.tolist(), family)


def test_reasoning_and_calls_are_trained_where_the_templates_render_them(folders):
    """The last turn's reasoning (Qwen3 and GLM-4.5 drop it before the last user message, Kimi K2 before the last
    answer), each call, and what ends the reply: GLM-4.5's next role token, <|observation|> after a call."""
    expected_last = {
        "qwen3": '<think>\nOnce more.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
        "\n</tool_call><|im_end|>",
        "glm-4.5": "\n<think>Once more.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo"
        "</arg_value>\n</tool_call><|observation|>",
        "kimi-k2": "<think>Once more.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:2"
        '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
    }
    for family, last in expected_last.items():
        tokenizer = load_tokenizer(folders[family])
        chat = tool_chat(family)
        ids, mask = encode_chat(check_conversation(chat["messages"], chat["tools"]), tokenizer)
        pieces = _trained_pieces(tokenizer, ids, mask)
        assert len(pieces) == 5 and pieces[-1] == last, (family, pieces)
        assert "Call again." not in tokenizer.decode(ids)  # an earlier turn's reasoning, dropped by the template
    glm = load_tokenizer(folders["glm-4.5"])
    chat = tool_chat("glm-4.5")
    ids, mask = encode_chat(check_conversation(chat["messages"], chat["tools"]), glm)
    assert _trained_pieces(glm, ids, mask)[1] == "\n<think></think>\nIt is 21 degrees in Paris.<|user|>"


def test_deepseek_v3_reply_with_empty_content_and_a_call(folders, references, tmp_path, capsys):
    """The template renders the call only for a null content (which transformers drops before rendering): the
    reply is <｜Assistant｜><｜end▁of▁sentence｜>, and its turn is that end token."""
    tokenizer, reference = load_tokenizer(folders["deepseek-v3"]), references["deepseek-v3"]
    messages = DEEPSEEK_ADD["messages"]
    with pytest.warns(UserWarning, match="renders no tool call of an assistant message, so those calls are not"):
        ids, mask = encode_chat(check_conversation(messages), tokenizer)
    assert ids.tolist() == list(reference.apply_chat_template(copy.deepcopy(messages), return_dict=False))
    assert mask.tolist() == expected_mask(reference, ids.tolist(), "deepseek-v3")
    assert _trained_pieces(tokenizer, ids, mask) == ["<｜end▁of▁sentence｜>", "2 plus 3 is 5.<｜end▁of▁sentence｜>"]
    assert "add" not in tokenizer.decode(ids)

    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(DEEPSEEK_ADD, ensure_ascii=False) + "\n", encoding="utf-8")
    assert inspect_data.main(inspect_data.Args(tokenizer=folders["deepseek-v3"], data=data)) == 0
    out = capsys.readouterr().out
    assert "<｜Assistant｜>[[<｜end▁of▁sentence｜>]]" in out and "[[2 plus 3 is 5.<｜end▁of▁sentence｜>]]" in out


def test_glm_replies_end_with_the_next_role_token(folders, tmp_path):
    """GLM-4.5 stops generating on <|user|> and <|observation|>: its template gives them without a
    generation_config.json too."""
    tokenizer = load_tokenizer(folders["glm-4.5"])
    user, observation = tokenizer.token_to_id("<|user|>"), tokenizer.token_to_id("<|observation|>")
    assert {user, observation} <= set(end_of_turn_ids(tokenizer))
    bare = write_family_folder(tmp_path / "glm", "glm-4.5")
    (bare / "generation_config.json").unlink()
    assert end_of_turn_ids(load_tokenizer(bare)) == (user, observation)
