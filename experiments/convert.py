"""Convert between Hugging Face folders (any registered family) and eqmoe (orbax) model checkpoints.

    python -m experiments.convert --hf path/to/Qwen3-30B-A3B --out ckpt/qwen3-30b   # HF -> eqmoe
    python -m experiments.convert --checkpoint ckpt/qwen3-30b --to-hf out/qwen3-30b  # eqmoe -> HF
    python -m experiments.convert --checkpoint runs/sft/checkpoints --to-hf out/sft-hf --max-shard-size 2GB
    python -m experiments.convert --checkpoint runs/lora/checkpoints --to-hf out/lora-peft --adapter-only

An eqmoe checkpoint loads with ``eqmoe.checkpoints.model_checkpoint.load_model``, ``sft --init-from-checkpoint``,
``generate --checkpoint`` and ``check_logits --checkpoint``; ``--checkpoint`` also takes a training run's
``checkpoints`` folder (its latest step, or ``--step``). Tokenizer and generation files travel with the weights.
A LoRA run's adapters are merged into the weights (``--merge``, the default) or written alone as a PEFT adapter
folder (``--adapter-only``) for ``peft.PeftModel.from_pretrained`` on the base; a checkpoint that holds only what
training changed reads the rest from its base folder, which must be the one it was trained on (``--base`` when
it moved).
Tensors move one at a time, so host memory holds about the model once plus one tensor (plus one output shard
when writing HF). Outputs are written under a temporary name and renamed; an existing output is refused
unless ``--overwrite``. Any problem with the inputs is one line on stderr and exit code 2.
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

from eqmoe.checkpoints import hf
from eqmoe.checkpoints.model_checkpoint import load_model, save_model
from eqmoe.checkpoints.peft import save_adapters
from eqmoe.checkpoints.run_metadata import RunMetadata
from eqmoe.data import tokenizer_vocab_size
from eqmoe.lora import has_lora, merge_lora
from experiments._cli import UsageError, guarded


@dataclass(frozen=True)
class Args:
    hf: Path | None = None
    """Hugging Face folder (any registered family) to convert to an eqmoe checkpoint (with --out)."""
    out: Path | None = None
    """eqmoe checkpoint folder to write (with --hf)."""
    checkpoint: Path | None = None
    """eqmoe checkpoint (or a training run's checkpoints folder) to export (with --to-hf)."""
    to_hf: Path | None = None
    """Hugging Face folder to write (with --checkpoint)."""
    step: int | None = None
    """With --checkpoint: the step to export (default: the latest)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the written tensors; auto keeps the source's (config.json's dtype for --hf)."""
    tokenizer: Path | None = None
    """tokenizer.json to check against the vocabulary and ship with the output (default: the source's)."""
    max_shard_size: str = "5GB"
    """With --to-hf: the largest safetensors shard (an index json is written when there are several)."""
    merge: bool = False
    """With --to-hf: fold LoRA adapters into the weights (what happens unless --adapter-only)."""
    adapter_only: bool = False
    """With --to-hf: write only the LoRA adapters, as a PEFT adapter folder (adapter_model.safetensors +
    adapter_config.json) for the base model."""
    base: Path | None = None
    """The base model folder of a checkpoint that holds only what training changed (default: where the run read it)."""
    overwrite: bool = False
    """Replace an existing output folder."""


def _side_files(source: Path, tokenizer: Path | None, vocab_size: int) -> list[Path]:
    """The tokenizer and generation files to copy, after checking that the tokenizer fits the vocabulary.

    A vocabulary padded beyond the tokenizer (Qwen pads to a multiple of 128) is fine; the reverse is not."""
    files = hf.side_files(source)
    if tokenizer is not None:
        files = [f for f in files if f.name != "tokenizer.json"] + [tokenizer]
    for path in files:
        if path.name == "tokenizer.json" and (size := tokenizer_vocab_size(path)) > vocab_size:
            raise UsageError(f"{path}: the tokenizer has {size} ids but the model's vocabulary has {vocab_size}")
    return files


def recorded_tokenizer(metadata: RunMetadata) -> Path | None:
    """The tokenizer.json a training run recorded in its checkpoint metadata, when it still exists."""
    path = metadata.tokenizer_path()
    return path if path is not None and path.is_file() else None


def _check_output(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise UsageError(f"{path}: already exists (pass --overwrite to replace it)")


def to_checkpoint(args: Args) -> str:
    assert args.hf is not None and args.out is not None
    if not (args.hf / "config.json").is_file():
        raise UsageError(f"{args.hf}: no config.json (not a Hugging Face model folder)")
    _check_output(args.out, args.overwrite)
    config = hf.read_config(args.hf)
    extra = _side_files(args.hf, args.tokenizer, config.vocab_size)
    dtype = hf.stored_dtype(args.hf) if args.dtype == "auto" else args.dtype
    model = hf.load(args.hf, dtype=dtype)
    save_model(
        model,
        args.out,
        metadata=RunMetadata(model.config, source=str(args.hf.absolute())),
        overwrite=args.overwrite,
        extra_files=extra,
    )
    return f"{args.hf} -> {args.out} ({dtype})"


def to_hf(args: Args) -> str:
    assert args.checkpoint is not None and args.to_hf is not None
    if not args.checkpoint.is_dir():
        raise UsageError(f"{args.checkpoint}: checkpoint folder not found")
    _check_output(args.to_hf, args.overwrite)
    if args.merge and args.adapter_only:
        raise UsageError("give --merge or --adapter-only, not both")
    model, metadata = load_model(args.checkpoint, step=args.step, base=args.base)
    merged = has_lora(model)
    if args.adapter_only:
        if not merged:
            raise UsageError(f"{args.checkpoint}: --adapter-only: the checkpoint has no LoRA adapters")
        base = metadata.base
        base_path = args.base or (base.path if base is not None and base.format == "hf" else None)
        save_adapters(model, args.to_hf, base_model=None if base_path is None else str(base_path), overwrite=True)
        return f"{args.checkpoint} -> {args.to_hf} (LoRA adapters only, PEFT layout)"
    model = merge_lora(model)  # LoRA adapters folded into the weights transformers reads
    tokenizer = args.tokenizer or recorded_tokenizer(metadata)
    extra = _side_files(args.checkpoint, tokenizer, model.config.vocab_size)
    dtype = None if args.dtype == "auto" else args.dtype
    hf.save(model, args.to_hf, dtype=dtype, max_shard_size=args.max_shard_size, overwrite=True, extra_files=extra)
    note = ", LoRA adapters merged" if merged else ""
    return f"{args.checkpoint} -> {args.to_hf} ({dtype or model.config.param_dtype}{note})"


def run(args: Args) -> str:
    if args.hf is not None and args.out is not None and args.checkpoint is None and args.to_hf is None:
        return to_checkpoint(args)
    if args.checkpoint is not None and args.to_hf is not None and args.hf is None and args.out is None:
        return to_hf(args)
    raise UsageError("give either --hf DIR --out DIR (HF -> eqmoe) or --checkpoint DIR --to-hf DIR (eqmoe -> HF)")


def main(args: Args) -> int:
    start = time.perf_counter()
    done = guarded("convert", run, args)
    if done is None:
        return 2
    print(f"convert: {done} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
