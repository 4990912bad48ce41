"""A tiny eqmoe model exported as a transformers folder with its tokenizer, for the lm-eval tests (their local tasks:
:mod:`experiments._lm_eval_tasks`)."""

from pathlib import Path

import jax
from chat_fixtures import write_tokenizer_folder

from eqmoe import Transformer, presets
from eqmoe.checkpoints import hf
from eqmoe.data import load_tokenizer
from experiments._lm_eval_tasks import TASKS, write_tasks

__all__ = ["TASKS", "write_model_folder", "write_tasks"]


def write_model_folder(folder: Path, *, seed: int = 0, vocab_padding: int = 0, template: str | None = None) -> Path:
    """A float32 ``qwen3-moe-tiny`` (two layers) with random weights, written by eqmoe's Hugging Face writer beside
    a byte-level BPE tokenizer (with ``template`` as its chat template); its vocabulary the tokenizer's plus
    ``vocab_padding`` rows (negative: too small)."""
    tokenizer_folder = write_tokenizer_folder(folder.parent / f"{folder.name}-tokenizer", template)
    vocab = load_tokenizer(tokenizer_folder, chat=False).vocab_size + vocab_padding
    base = presets.get("qwen3-moe-tiny")
    config = base.replace(vocab_size=vocab, layers=base.layers[:2], init_std=0.2)
    model = Transformer(config, key=jax.random.key(seed))
    extra = [tokenizer_folder / "tokenizer.json", tokenizer_folder / "tokenizer_config.json"]
    return hf.save(model, folder, extra_files=extra)
