"""Chat data end to end: every file layout through inspect_data, SFT of a tiny HF checkpoint with its own
template on Parquet tool-use data, generation prompts, the tokenisation cache, and bad input."""

import copy
import dataclasses
import json

import pytest
from chat_fixtures import TEMPLATES, TOOL_CHAT, write_tokenizer_folder

from eqmoe.data import load_tokenizer, tokenize_file
from experiments import generate, inspect_data, sft
from tests.conftest import save_tiny_hf

transformers = pytest.importorskip("transformers")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

REASONER = (TEMPLATES / "reasoner.jinja").read_text()


def _tool_chats(count: int) -> list[dict]:
    """Variations of the fixture's tool-use conversation (arguments as JSON text, as Parquet users store them)."""
    chats = []
    for i in range(count):
        city, temp = ["Paris", "Lima", "Oslo"][i % 3], 10 + i % 7
        chat = copy.deepcopy(TOOL_CHAT)
        messages = chat["messages"]
        messages[1]["content"] = f"What's the weather in {city}?"
        messages[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": city})
        messages[3]["content"] = json.dumps({"temp": temp})
        messages[4]["content"] = f"It is {temp} degrees in {city}."
        messages[5]["content"] = "And tomorrow?"
        chat["tools"] = json.dumps(chat["tools"])
        chats.append(chat)
    return chats


def _canonical(chat: dict) -> tuple[list[dict], list[dict] | None]:
    tools = chat.get("tools")
    return chat["messages"], json.loads(tools) if isinstance(tools, str) else tools


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    return write_tokenizer_folder(tmp_path_factory.mktemp("tok") / "tok", REASONER)


# --- every layout and file format, through inspect_data --json --------------------------------------------


def _layouts(chats: list[dict]) -> dict[str, list[dict]]:
    sharegpt_from = {"system": "system", "user": "human", "assistant": "gpt", "tool": "observation"}
    plain = [{"messages": [m for m in c["messages"] if "tool_calls" not in m and m["role"] != "tool"]} for c in chats]
    return {
        "messages": chats,
        "sharegpt": [
            {"conversations": [{"from": sharegpt_from[m["role"]], "value": m["content"]} for m in c["messages"]]}
            for c in plain
        ],
        "prompt_completion": [
            {"prompt": c["messages"][1]["content"], "completion": c["messages"][4]["content"]} for c in chats
        ],
    }


def _expected_messages(layout: str, record: dict) -> tuple[list[dict], list[dict] | None]:
    if layout == "messages":
        return _canonical(record)
    if layout == "sharegpt":
        roles = {"system": "system", "human": "user", "gpt": "assistant", "observation": "tool"}
        return [{"role": roles[t["from"]], "content": t["value"]} for t in record["conversations"]], None
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}], None


def _write(fmt: str, records: list[dict], folder):
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        path = folder / "data.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return path, {}
    if fmt == "json":
        path = folder / "data.json"
        path.write_text(json.dumps({"version": 1, "rows": records}))
        return path, {"data_field": "rows"}
    if fmt == "parquet":
        path = folder / "data.parquet"
        pq.write_table(pa.Table.from_pylist(records), path)
        return path, {}
    datasets = pytest.importorskip("datasets")
    if fmt == "datasets":
        path = folder / "saved"
        datasets.DatasetDict(
            {"train": datasets.Dataset.from_list(records), "test": datasets.Dataset.from_list(records[:1])}
        ).save_to_disk(str(path))
        return path, {"split": "train"}
    path = folder / "data.arrow"
    table = pa.Table.from_pylist(records)
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)
    return path, {}


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "datasets", "arrow"])
@pytest.mark.parametrize("layout", ["messages", "sharegpt", "prompt_completion"])
def test_inspect_data_json_for_every_layout_and_format(tmp_path, capsys, tokenizer_folder, layout, fmt):
    records = _layouts(_tool_chats(4))[layout]
    records.append({**records[0], **({"messages": records[0]["messages"][:2]} if layout == "messages" else {})})
    path, options = _write(fmt, records, tmp_path)
    args = inspect_data.Args(tokenizer=tokenizer_folder, data=path, json=True, **options)
    assert inspect_data.main(args) == 0
    out, err = capsys.readouterr()
    objects = [json.loads(line) for line in out.splitlines()]
    assert len(objects) == len(records) and f'"layout": "{layout}"' in err
    reference = transformers.AutoTokenizer.from_pretrained(tokenizer_folder)
    for record, obj in zip(records, objects, strict=True):
        messages, tools = _expected_messages(layout, record)
        expected = reference.apply_chat_template(messages, tools=tools, return_dict=False)
        assert obj["ids"] == list(expected) and len(obj["loss_mask"]) == len(obj["ids"])
        assert set(obj["loss_mask"]) <= {0, 1} and obj["trained"] == any(m["role"] == "assistant" for m in messages)
        assert any(obj["loss_mask"]) == obj["trained"]
    assert all(":" in obj["where"] for obj in objects)


def test_inspect_data_human_view_marks_trained_spans_and_packing(tmp_path, capsys, tokenizer_folder):
    path, _ = _write("jsonl", _tool_chats(3), tmp_path)
    assert inspect_data.main(inspect_data.Args(tokenizer=tokenizer_folder, data=path, limit=1, seq_len=300)) == 0
    out = capsys.readouterr().out
    assert "[[It is 10 degrees in Paris.<|im_end|>]]" in out and out.count("--- ") == 1
    assert "messages layout" in out and "3 conversations" in out and "packed rows" in out


# --- the tokenisation cache --------------------------------------------------------------------------------


def test_second_tokenisation_reads_the_cache_and_a_template_change_misses_it(tmp_path, tokenizer_folder):
    path, _ = _write("parquet", _tool_chats(5), tmp_path)
    first = tokenize_file(path, load_tokenizer(tokenizer_folder), cache_dir=tmp_path / "cache")
    second = tokenize_file(path, load_tokenizer(tokenizer_folder), cache_dir=tmp_path / "cache")
    assert not first.cached and second.cached and len(second) == 5
    assert (first.ids == second.ids).all() and (first.loss_mask == second.loss_mask).all()
    other = load_tokenizer(tokenizer_folder, template_vars={"enable_thinking": False})
    assert not tokenize_file(path, other, cache_dir=tmp_path / "cache").cached
    assert len(list((tmp_path / "cache").glob("*/info.json"))) == 2


# --- SFT of a tiny HF checkpoint with its own template, then generation --------------------------------------


def _sft_args(out_dir, steps, **data) -> sft.Args:
    run = sft.RunOptions(steps=steps, out_dir=out_dir, checkpoint_every=steps, eval_every=1000, log_every=5, samples=1)
    return sft.Args(
        model=sft.ModelOptions(preset="qwen3-moe-micro"),
        data=sft.DataOptions(seq_len=320, batch_size=4, **data),
        optim=dataclasses.replace(sft.Args().optim, learning_rate=3e-3, warmup_steps=5),
        run=run,
    )


def test_sft_from_hf_folder_with_template_on_parquet_then_generate_with_the_same_prompt(tmp_path):
    folder = tmp_path / "hf"
    save_tiny_hf(folder, vocab_size=512, num_hidden_layers=2)
    write_tokenizer_folder(folder, REASONER)
    (folder / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    path, _ = _write("parquet", _tool_chats(24), tmp_path)
    args = _sft_args(tmp_path / "run", 40, data=path, tokenizer=folder)
    args = dataclasses.replace(args, model=dataclasses.replace(args.model, init_from_hf=folder))
    sft.run(args)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["cross_entropy"] for r in records if "cross_entropy" in r]
    assert losses[-1] < 0.6 * losses[0]

    messages, tools = _canonical(_tool_chats(1)[0])
    conversation = tmp_path / "ask.json"
    conversation.write_text(json.dumps({"messages": messages[:-1], "tools": tools}))
    result = generate.run(
        generate.Args(checkpoint=tmp_path / "run" / "checkpoints", messages=conversation, max_new_tokens=4)
    )
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    expected = reference.apply_chat_template(messages[:-1], tools=tools, add_generation_prompt=True, return_dict=False)
    assert result["prompt_ids"] == list(expected)


# --- bad input: one line, exit 2, nothing written ------------------------------------------------------------


def _bad_cases(tmp_path):
    good = _tool_chats(3)
    cases = {}

    def case(name, *, template=REASONER, records=good, fmt="jsonl", **options):
        folder = write_tokenizer_folder(tmp_path / name / "tok", template)
        path, defaults = _write(fmt, records, tmp_path / name)
        cases[name] = ({"tokenizer": folder, "data": path, **defaults, **options}, None)

    case("raises", template="{{ raise_exception('this template needs a system turn') }}")
    needs_content = REASONER.replace(
        "{%- set content = text(message.content) if message.content is defined else '' %}",
        "{%- set content = message.content + '' %}",
    )
    no_content = copy.deepcopy(good)
    del no_content[1]["messages"][2]["content"]
    case("missing field", template=needs_content, records=no_content)
    bot = copy.deepcopy(good)
    bot[2]["messages"][1]["role"] = "bot"
    case("unknown role", records=bot)
    dropping = "{% for m in messages %}{% if m.role != 'assistant' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"  # noqa: E501
    case("turns not found", template=dropping)
    case("no column", fmt="parquet", data_field="chat")
    case("empty split", split="test")  # its data: a DatasetDict written by the test
    case("sandbox", template="{{ ''.__class__.__mro__ }}")
    return cases


EXPECTED_ERRORS = {
    "raises": ("data.jsonl:1", "this template needs a system turn"),
    "missing field": ("data.jsonl:2", "content"),
    "unknown role": ("data.jsonl:3", "role='bot' is invalid"),
    "turns not found": ("data.jsonl:1", "cannot be found"),
    "no column": ("data.parquet", "no column 'chat'"),
    "empty split": ("saved", "no rows"),
    "sandbox": ("data.jsonl:1", "sandbox refused"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_ERRORS))
def test_bad_chat_data_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, name, monkeypatch):
    options, _ = _bad_cases(tmp_path)[name]
    if name == "empty split":  # a DatasetDict whose test split is empty
        datasets = pytest.importorskip("datasets")
        records = _tool_chats(2)
        datasets.DatasetDict(
            {"train": datasets.Dataset.from_list(records), "test": datasets.Dataset.from_list(records).select([])}
        ).save_to_disk(str(tmp_path / "saved"))
        options["data"] = tmp_path / "saved"
    monkeypatch.setenv("EQMOE_CACHE", str(tmp_path / "cache"))
    args = _sft_args(tmp_path / "out", 2, **options)
    assert sft.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    where, why = EXPECTED_ERRORS[name]
    assert where in err[-1] and why in err[-1], err[-1]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert not any((tmp_path / "cache").rglob("*.bin"))
