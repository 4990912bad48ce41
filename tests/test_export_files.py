"""Exports carry what transformers needs to read text as the run did: after a LoRA SFT from a folder with its own
tokenizer, the merged and the PEFT export template every conversation to the ids eqmoe trained on, and
transformers' generate stops on the run's end-of-turn ids, with the folder's template or a ``--chat-template`` file.
Named templates, a byte-tokenizer run and a tokenizer or template that is gone or too large."""

import dataclasses
import json

import pytest
from chat_fixtures import TEMPLATES, TOOLS, write_chat_model_folder, write_tokenizer_folder

from eqmoe.checkpoints import hf
from eqmoe.checkpoints.export_files import export_files
from eqmoe.checkpoints.model_checkpoint import save_model
from eqmoe.checkpoints.run_metadata import RunMetadata
from eqmoe.data import check_conversation, encode_chats, end_of_turn_ids, load_tokenizer, prompt_ids, render
from experiments import convert, sft

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

REASONER = (TEMPLATES / "reasoner.jinja").read_text()
TAGGED = TEMPLATES / "tagged.jinja"


def _conversations(count: int) -> list[list[dict]]:
    return [
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"What is {i % 7} plus {i % 5}?"},
            {"role": "assistant", "content": str(i % 7 + i % 5)},
            {"role": "user", "content": "And the weather in Paris?"},
            {"role": "assistant", "content": f"It is {10 + i} degrees in Paris."},
        ]
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Qwen3-MoE folder with its own BPE tokenizer, chat template and generation settings."""
    return write_chat_model_folder(tmp_path_factory.mktemp("base") / "hf", REASONER)


def _train(base, out, chat_template, variables: dict) -> object:
    """A 3-step LoRA SFT of ``base`` on its tokenizer; its checkpoints folder."""
    data = out / "chats.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in _conversations(8)))
    args = sft.Args(
        model=sft.ModelOptions(init_from_hf=base, lora_rank=8),
        data=sft.DataOptions(
            tokenizer=None if chat_template is None else base,  # None: the starting folder's own
            chat_template=chat_template,
            template_var=tuple(f"{key}={json.dumps(value)}" for key, value in variables.items()),
            data=data,
            cache_dir=out / "cache",
            seq_len=256,
            batch_size=2,
        ),
        optim=dataclasses.replace(sft.Args().optim, warmup_steps=1),
        run=sft.RunOptions(steps=3, out_dir=out, checkpoint_every=10, eval_every=1000, log_every=1, samples=0),
    )
    sft.run(args)
    return out / "checkpoints"


class _ForceAt(transformers.LogitsProcessor):
    """Makes ``token`` the only choice once the sequence is ``length`` long."""

    def __init__(self, token: int, length: int):
        self.token, self.length = token, length

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] == self.length:
            scores = torch.full_like(scores, -float("inf"))
            scores[:, self.token] = 0.0
        return scores


def _assert_stops(new: list[int], stops: list[int], limit: int) -> None:
    """Generation ended at the first stop id, or at ``limit`` new tokens when none came."""
    first = next((i for i, token in enumerate(new) if token in stops), None)
    assert new == new[: first + 1] if first is not None else len(new) == limit, (new, stops)


@pytest.mark.parametrize("case", ["folder template", "chat-template file"])
def test_merged_and_peft_exports_template_and_stop_as_the_run_did(base, tmp_path, capsys, case):
    template = None if case == "folder template" else TAGGED
    variables = {"enable_thinking": False} if template is None else {}
    checkpoints = _train(base, tmp_path / "run", template, variables)
    log = capsys.readouterr().err
    if template is None:  # with --init-from-hf alone: the folder's tokenizer and template, a fine-tuning rate
        line = next(line for line in log.splitlines() if line.startswith("data:"))
        assert f"{base / 'tokenizer.json'}" in line and "(the starting model's)" in line, line
        assert "tokenizer_config.json" in line and "(the LoRA fine-tuning default)" in log
    ours = load_tokenizer(base, chat_template=template, template_vars=variables)  # what the run rendered with
    conversations = _conversations(3)
    trained = [e.ids.tolist() for e in encode_chats(conversations, ours)]
    prompt = prompt_ids(conversations[0][:-1], ours).tolist()
    stops = list(end_of_turn_ids(ours))
    end_of_turn = "<|im_end|>" if template is None else "<|eot_id|>"
    assert stops == [ours.token_to_id(end_of_turn), ours.token_to_id("<|endoftext|>")]  # the turn's, the folder's

    for name, flags in (("merged", {}), ("adapter", {"adapter_only": True})):
        out = tmp_path / name
        capsys.readouterr()
        assert convert.main(convert.Args(checkpoint=checkpoints, to_hf=out, **flags)) == 0
        line = capsys.readouterr().out
        assert f"stops on ids {stops}" in line and ("enable_thinking=false" in line) == bool(variables), line
        assert (out / "README.md").is_file() == bool(variables)
        assert (out / "chat_template.jinja").read_text() == (REASONER if template is None else TAGGED.read_text())
        assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())

        tokenizer = transformers.AutoTokenizer.from_pretrained(out)
        for messages, ids in zip(conversations, trained, strict=True):
            assert tokenizer.apply_chat_template(messages, return_dict=False) == ids
        rendered = tokenizer.apply_chat_template(
            conversations[0][:-1], add_generation_prompt=True, return_dict=False, **variables
        )
        assert rendered == prompt
        generation = transformers.GenerationConfig.from_pretrained(out)
        assert list(generation.eos_token_id) == stops
        assert (generation.do_sample, generation.temperature, generation.top_k) == (True, 0.6, 20)
        again = load_tokenizer(out, template_vars=variables)  # eqmoe reads the export the same way
        assert [e.ids.tolist() for e in encode_chats(conversations, again)] == trained
        assert list(end_of_turn_ids(again)) == stops

    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert list(merged.generation_config.eos_token_id) == stops
    on_base = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter"
    )
    # PeftModel keeps the base's generation settings: the adapter folder's are passed in.
    adapter_generation = {"generation_config": transformers.GenerationConfig.from_pretrained(tmp_path / "adapter")}
    ids = torch.tensor([prompt])
    for model, settings in ((merged, {}), (on_base, adapter_generation)):
        greedy = dict(max_new_tokens=8, do_sample=False, **settings)
        with torch.no_grad():
            free = model.generate(input_ids=ids, **greedy)[0, len(prompt) :].tolist()
            force = transformers.LogitsProcessorList([_ForceAt(stops[0], len(prompt) + 1)])
            forced = model.generate(input_ids=ids, logits_processor=force, **greedy)[0, len(prompt) :].tolist()
        _assert_stops(free, stops, 8)
        _assert_stops(forced, stops, 8)
        assert forced[-1] in stops and len(forced) <= 2  # the run's end of turn, absent from the base's settings


def test_named_templates_travel_in_the_tokenizer_config_for_transformers_and_eqmoe(tmp_path):
    # transformers 5 saves named templates as chat_template.jinja plus additional_chat_templates/NAME.jinja; an
    # export is flat, so they travel as tokenizer_config.json's list, and no chat_template.jinja may shadow it.
    folder = write_tokenizer_folder(tmp_path / "tok")
    (folder / "chat_template.jinja").write_text(REASONER)
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text(TAGGED.read_text())
    ours = load_tokenizer(folder)
    assert sorted(ours.chat_template.sources) == ["default", "tool_use"]
    (tmp_path / "scratch").mkdir()
    export = export_files(None, tmp_path, tmp_path / "scratch", ours.vocab_size, tokenizer=folder)
    (tmp_path / "out").mkdir()
    for path in export.files:
        (tmp_path / "out" / path.name).write_bytes(path.read_bytes())
    assert not (tmp_path / "out" / "chat_template.jinja").exists()
    messages = _conversations(1)[0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")  # no config.json, as a PEFT folder
    again = load_tokenizer(tmp_path / "out")
    for tools in (None, TOOLS):
        text = render(check_conversation(messages, tools), ours)
        assert tokenizer.apply_chat_template(messages, tools=tools, tokenize=False) == text
        assert tokenizer.apply_chat_template(messages, tools=tools, return_dict=False) == ours.encode(text)
        assert render(check_conversation(messages, tools), again) == text
    assert text.startswith("<|begin_of_text|>")  # the tool_use template rendered


def test_a_byte_run_exports_no_tokenizer_and_a_missing_or_large_one_is_one_line(base, tmp_path, capsys):
    model = hf.load(base)
    save_model(model, tmp_path / "bytes", metadata=RunMetadata(model.config, bytes_tokenizer=True))
    assert convert.main(convert.Args(checkpoint=tmp_path / "bytes", to_hf=tmp_path / "o1")) == 0
    assert "no tokenizer files (trained on eqmoe's byte tokenizer)" in capsys.readouterr().out
    assert not (tmp_path / "o1" / "tokenizer.json").exists()

    from tokenizers import Tokenizer, models

    big = tmp_path / "big" / "tokenizer.json"
    big.parent.mkdir()
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(600)}, unk_token="w0")).save(str(big))
    cases = [
        (RunMetadata(model.config, tokenizer=str(tmp_path / "gone")), {}, "the tokenizer the run trained with is gone"),
        (
            RunMetadata(model.config, tokenizer=str(base), chat_template=str(tmp_path / "gone.jinja")),
            {},
            "the chat template the run trained with is gone",
        ),
        (RunMetadata(model.config, tokenizer=str(base)), {"tokenizer": big}, "the tokenizer has 600 ids but"),
    ]
    for i, (metadata, flags, message) in enumerate(cases):
        save_model(model, tmp_path / f"c{i}", metadata=metadata)
        capsys.readouterr()
        assert convert.main(convert.Args(checkpoint=tmp_path / f"c{i}", to_hf=tmp_path / f"x{i}", **flags)) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and not (tmp_path / f"x{i}").exists(), err
