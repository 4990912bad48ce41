"""Hub ids ``ORG/NAME[@REVISION]`` wherever a model or tokenizer folder is typed, read offline from a Hugging Face
cache laid out as ``huggingface_hub.snapshot_download`` leaves it."""

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eqmoe.checkpoints import hf
from eqmoe.checkpoints.model_checkpoint import load_model
from eqmoe.data import load_tokenizer
from eqmoe.data.hub import resolve_folder
from experiments import check_logits, convert, sft
from tests.conftest import save_tiny_hf

ROOT = Path(__file__).resolve().parents[1]
REPO = "tiny-org/tiny-moe"
MAIN = hashlib.sha1(b"main").hexdigest()
OLD = hashlib.sha1(b"old").hexdigest()


def _word_tokenizer(folder: Path) -> None:
    """A whitespace word tokenizer of 25 ids with the chat specials the built-in ChatML needs."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", *"0123456789", "+", "=", "?", "the", "is", "of", "capital", "france", "sort", "add", "reverse"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(folder / "tokenizer.json"))


def _cache_snapshot(cache: Path, repo: str, commit: str, folder: Path, ref: str | None) -> Path:
    """``folder``'s files as a snapshot of ``repo`` at ``commit``: content-named blobs, the snapshot's files
    relative symlinks to them, and ``refs/<ref>`` holding the commit."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir(exist_ok=True)
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    if ref is not None:
        (storage / "refs").mkdir(exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A Hugging Face cache holding REPO at two commits: MAIN (branch main) and OLD (tag v1), different weights."""
    root = tmp_path_factory.mktemp("hub")
    for commit, seed, ref in ((MAIN, 0, "main"), (OLD, 1, "v1")):
        folder = root / f"saved-{seed}"
        save_tiny_hf(folder, seed=seed)
        _word_tokenizer(folder)
        _cache_snapshot(root / "cache", REPO, commit, folder, ref)
    return (root / "cache").resolve()  # as huggingface_hub names it


def _snapshot(cache: Path, commit: str) -> Path:
    return cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit


@pytest.fixture
def offline(cache, monkeypatch, tmp_path) -> Path:
    """HF_HUB_OFFLINE=1 with HF_HUB_CACHE=cache, in this process (huggingface_hub read both at import) and for
    the commands it starts; the working folder holds no ``tiny-org`` folder."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    return cache


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_hub_id_is_its_cached_snapshot_offline(offline, tmp_path):
    assert resolve_folder(tmp_path) == tmp_path
    assert resolve_folder(tmp_path / "missing") == tmp_path / "missing"  # a path: the caller reports it missing
    assert resolve_folder(REPO) == _snapshot(offline, MAIN)
    assert resolve_folder(f"{REPO}@{OLD}") == _snapshot(offline, OLD)  # a commit hash
    assert resolve_folder(f"{REPO}@v1", files="tokenizer") == _snapshot(offline, OLD)  # a tag
    tokenizer = load_tokenizer(Path(REPO))
    assert tokenizer.path == str(_snapshot(offline, MAIN) / "tokenizer.json") and tokenizer.vocab_size == 25
    with pytest.raises(FileNotFoundError, match=r"tiny-org/absent: .*not in the Hugging Face cache \(HF_HUB_OFFLINE"):
        resolve_folder("tiny-org/absent")
    with pytest.raises(FileNotFoundError, match=f"{REPO}@{'0' * 40}: .*not in the Hugging Face cache"):
        resolve_folder(f"{REPO}@{'0' * 40}")
    with pytest.raises(ValueError, match=r"a--b/c: no such folder, and not a Hub id ORG/NAME\[@REVISION\]"):
        resolve_folder("a--b/c")


def test_convert_check_logits_and_sft_take_a_hub_id(offline, tmp_path, capsys):
    assert convert.main(convert.Args(hf=Path(REPO), out=tmp_path / "ckpt")) == 0
    _, metadata = load_model(tmp_path / "ckpt")
    assert metadata.source == str(_snapshot(offline, MAIN))  # where the weights were read, not the id
    assert (tmp_path / "ckpt" / "tokenizer.json").is_file()
    capsys.readouterr()
    assert check_logits.main(check_logits.Args(hf=Path(REPO), tokenizer=Path(REPO))) == 0
    assert "PASS" in capsys.readouterr().out

    run = sft.RunOptions(steps=2, out_dir=tmp_path / "run", checkpoint_every=2, eval_every=2, log_every=1, samples=0)
    data = sft.DataOptions(tokenizer=Path(REPO), seq_len=64, batch_size=2, train_examples=40, eval_examples=4)
    args = sft.Args(model=sft.ModelOptions(init_from_hf=Path(REPO)), data=data, run=run)
    assert sft.main(args) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["config"]["vocab_size"] == 97

    capsys.readouterr()
    assert convert.main(convert.Args(hf=Path("tiny-org/absent"), out=tmp_path / "o1")) == 2
    assert "convert: tiny-org/absent: no such folder, and not in the Hugging Face cache" in _one_line_error(capsys)
    absent = sft.Args(
        model=sft.ModelOptions(init_from_hf=Path("tiny-org/absent")),
        data=data,
        run=dataclasses.replace(run, out_dir=tmp_path / "o2"),
    )
    assert sft.main(absent) == 2
    assert "sft: tiny-org/absent: no such folder" in _one_line_error(capsys)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2" / "summary.json").exists()


def test_convert_reads_a_hub_id_at_a_commit_in_a_fresh_process(offline, tmp_path):
    """The environment variables alone, read by a new process, select the offline cache."""
    command = [sys.executable, "-m", "experiments.convert", "--hf", f"{REPO}@{OLD}", "--out", str(tmp_path / "old")]
    done = subprocess.run(command, cwd=ROOT, env=os.environ, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    model, metadata = load_model(tmp_path / "old")
    assert metadata.source == str(_snapshot(offline, OLD))
    np.testing.assert_array_equal(model.embed, hf.load(_snapshot(offline, OLD)).embed)  # the old commit's weights
    assert not np.array_equal(model.embed, hf.load(_snapshot(offline, MAIN)).embed)
