"""A tokenizer that does not fit the model it fine-tunes is one line (that the folder's own tokenizer, template and a
fine-tuning learning rate are the defaults is shown by tests/test_export_files.py, on the ids transformers renders)."""

import json

import pytest
import tyro
from chat_fixtures import TEMPLATES, write_chat_model_folder

from experiments import sft

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [
        {"role": "user", "content": f"What is {i % 7} plus {i % 5}?"},
        {"role": "assistant", "content": str(i % 7 + i % 5)},
        {"role": "user", "content": "And the weather in Paris?"},
        {"role": "assistant", "content": f"It is {10 + i} degrees in Paris."},
    ]
    for i in range(12)
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("model")
    write_chat_model_folder(root / "hf", (TEMPLATES / "reasoner.jinja").read_text())
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    return root


def _parse(*words) -> sft.Args:
    return tyro.cli(sft.Args, args=[str(w) for w in words], config=(tyro.conf.OmitArgPrefixes,))


def test_a_tokenizer_that_does_not_fit_the_model_is_one_line(folder, tmp_path, capsys):
    from tokenizers import Tokenizer, models

    small = tmp_path / "small"
    small.mkdir()
    word_level = Tokenizer(models.WordLevel({f"w{i}": i for i in range(40)}, unk_token="w0"))
    word_level.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    word_level.save(str(small / "tokenizer.json"))
    capsys.readouterr()
    args = _parse(
        f"--init-from-hf={folder / 'hf'}",
        f"--data={folder / 'chats.jsonl'}",
        "--lora-rank=8",
        f"--tokenizer={small}",
        f"--out-dir={tmp_path / 'run'}",
    )
    assert sft.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "43 ids" in err[0] and "not the tokenizer the model was trained with" in err[0], err
    assert not (tmp_path / "run").exists()
