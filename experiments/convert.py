"""Convert between Hugging Face folders (any registered family) and eqmoe (orbax) model checkpoints.

    python -m experiments.convert --hf path/to/Qwen3-30B-A3B --out ckpt/qwen3-30b   # HF -> eqmoe
    python -m experiments.convert --hf Qwen/Qwen3-30B-A3B --out ckpt/qwen3-30b      # a Hub id, via the HF cache
    python -m experiments.convert --checkpoint ckpt/qwen3-30b --to-hf out/qwen3-30b  # eqmoe -> HF
    python -m experiments.convert --checkpoint runs/sft/checkpoints --to-hf out/sft-hf --max-shard-size 2GB
    python -m experiments.convert --checkpoint runs/lora/checkpoints --to-hf out/lora-peft --adapter-only

An eqmoe checkpoint loads with ``eqmoe.checkpoints.model_checkpoint.load_model``, ``sft --init-from-checkpoint``,
``generate --checkpoint`` and ``check_logits --checkpoint``; ``--checkpoint`` also takes a training run's
``checkpoints`` folder (its latest step, or ``--step``). Tokenizer and generation files travel with the weights:
an export (merged or ``--adapter-only``) carries the run's tokenizer files, the chat template it trained with
(``chat_template.jinja``) and a ``generation_config.json`` that stops on its end-of-turn ids, so transformers
tokenizes, templates and stops as the run did; template variables the files cannot hold (``enable_thinking``) are
printed and noted in ``README.md`` (:mod:`eqmoe.checkpoints.export_files`). A PEFT folder's generation settings
are not read by ``PeftModel``: pass ``GenerationConfig.from_pretrained(adapter_dir)`` to ``generate``.
A LoRA run's adapters are merged into the weights (``--merge``, the default) or written alone as a PEFT adapter
folder (``--adapter-only``) for ``peft.PeftModel.from_pretrained`` on the base; a checkpoint that holds only what
training changed reads the rest from its base folder, which must be the one it was trained on (``--base`` when
it moved).
Tensors move one at a time, so host memory holds about the model once plus one tensor (also
when writing HF). Outputs are written under a temporary name and renamed; an existing output is refused
unless ``--overwrite``. Any problem with the inputs is one line on stderr and exit code 2.
A block-FP8 folder (DeepSeek-V3's published layout) or an MXFP4 one (gpt-oss's published expert weights) is
dequantized while it is read, and the line saying so names the dtype of the unquantized output ("... holds MXFP4
expert weights, dequantized: OUT is unquantized bfloat16"); any other ``quantization_config`` (INT4, bitsandbytes,
...) is refused.
"""

import dataclasses
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

from eqmoe.checkpoints import hf
from eqmoe.checkpoints.export_files import export_files
from eqmoe.checkpoints.model_checkpoint import load_model, save_model
from eqmoe.checkpoints.peft import save_adapters
from eqmoe.checkpoints.quantized import read_scheme
from eqmoe.checkpoints.run_metadata import RunMetadata
from eqmoe.data import tokenizer_vocab_size
from eqmoe.data.hub import resolve_folder
from eqmoe.data.tokenizer import TIKTOKEN_FILE, TOKENIZER_FILE_NAMES, check_tokenizer_fits, tokenizer_file
from eqmoe.lora import has_lora, merge_lora
from experiments._cli import UsageError, guarded
from experiments.options import ModelSourceOptions, TokenizerOption


@dataclass(frozen=True)
class Args(ModelSourceOptions, TokenizerOption):
    out: Path | None = None
    """eqmoe checkpoint folder to write (with --hf)."""
    to_hf: Path | None = None
    """Hugging Face folder to write (with --checkpoint)."""
    save_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the written tensors; auto keeps the source's (config.json's dtype for --hf)."""
    max_shard_size: str = "5GB"
    """With --to-hf: the largest safetensors shard (an index json is written when there are several)."""
    merge: bool = False
    """With --to-hf: fold LoRA adapters into the weights (what happens unless --adapter-only)."""
    adapter_only: bool = False
    """With --to-hf: write only the LoRA adapters, as a PEFT adapter folder (adapter_model.safetensors +
    adapter_config.json) for the base model."""
    overwrite: bool = False
    """Replace what is already at the output (the run in --out-dir, or the output folder) instead of refusing."""


def _side_files(source: Path, tokenizer: Path | None, vocab_size: int) -> list[Path]:
    """The tokenizer and generation files to copy, after checking that the tokenizer fits the vocabulary.

    ``tokenizer`` (a folder: its ``tokenizer.json``, else its ``tiktoken.model``) replaces the source's tokenizer
    file; a ``tiktoken.model`` brings the ``tokenizer_config.json`` beside it (its special tokens) and the
    ``tokenization_*.py`` transformers reads it with. The tokenizer read (the given one, else the source's:
    :func:`eqmoe.data.tokenizer.tokenizer_file`) must fit the vocabulary; one padded beyond the tokenizer (Qwen pads
    to a multiple of 128) is fine, the reverse is not."""
    files = hf.side_files(source)
    file = tokenizer_file(source)
    if tokenizer is not None:
        tokenizer = resolve_folder(tokenizer, files="tokenizer")
        file = tokenizer_file(tokenizer) if tokenizer.is_dir() else tokenizer
        if file is None:
            looked = " and ".join(TOKENIZER_FILE_NAMES)
            raise UsageError(f"{tokenizer}: no tokenizer in this folder (looked for {looked})")
        if not file.is_file():
            raise UsageError(f"{file}: tokenizer file not found")
        replaced = set(TOKENIZER_FILE_NAMES)
        brought = [file]
        if file.name == TIKTOKEN_FILE:  # its special tokens and the code transformers reads it with
            code = [path for path in hf.side_files(file.parent) if path.name.startswith("tokenization_")]
            config = [path for path in [file.parent / "tokenizer_config.json"] if path.is_file()]
            brought += config + code  # the source's tokenizer_config.json goes even when none comes: as it was read
            replaced |= {"tokenizer_config.json"} | {path.name for path in code}
        files = [f for f in files if f.name not in replaced] + brought
    if file is not None:
        check_tokenizer_fits(tokenizer_vocab_size(file), vocab_size, file, error=UsageError)
    return files


def _check_output(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise UsageError(f"{path}: already exists (pass --overwrite to replace it)")


def to_checkpoint(args: Args) -> str:
    assert args.hf is not None and args.out is not None
    args = dataclasses.replace(args, hf=resolve_folder(args.hf))  # a Hub id: its cached snapshot, recorded as source
    if not (args.hf / "config.json").is_file():
        raise UsageError(f"{args.hf}: no config.json (not a Hugging Face model folder)")
    _check_output(args.out, args.overwrite)
    scheme = read_scheme(args.hf)  # refuses a quantization it cannot read before anything else
    config = hf.read_config(args.hf)
    extra = _side_files(args.hf, args.tokenizer, config.vocab_size)
    model = hf.load(args.hf, dtype=None if args.save_dtype == "auto" else args.save_dtype)  # None: config.json's dtype
    save_model(
        model,
        args.out,
        metadata=RunMetadata(model.config, source=str(args.hf.absolute())),
        overwrite=args.overwrite,
        extra_files=extra,
    )
    if scheme is not None:
        dtype = model.config.param_dtype
        print(f"convert: {args.hf} holds {scheme.describe()} weights, dequantized: {args.out} is unquantized {dtype}")
    return f"{args.hf} -> {args.out} ({model.config.param_dtype})"


def to_hf(args: Args) -> str:
    assert args.checkpoint is not None and args.to_hf is not None
    if not args.checkpoint.is_dir():
        raise UsageError(f"{args.checkpoint}: checkpoint folder not found")
    _check_output(args.to_hf, args.overwrite)
    if args.merge and args.adapter_only:
        raise UsageError("give --merge or --adapter-only, not both")
    model, metadata = load_model(args.checkpoint, step=args.step, base=args.base)
    merged = has_lora(model)
    if args.adapter_only and not merged:
        raise UsageError(f"{args.checkpoint}: --adapter-only: the checkpoint has no LoRA adapters")
    tokenizer = None if args.tokenizer is None else resolve_folder(args.tokenizer, files="tokenizer")
    with tempfile.TemporaryDirectory() as scratch:
        extra = export_files(metadata, args.checkpoint, Path(scratch), model.config.vocab_size, tokenizer)
        if args.adapter_only:
            base = metadata.base
            base_path = args.base or (base.path if base is not None and base.format == "hf" else None)
            base_model = None if base_path is None else str(base_path)
            save_adapters(model, args.to_hf, base_model=base_model, overwrite=True, extra_files=extra.files)
            return f"{args.checkpoint} -> {args.to_hf} (LoRA adapters only, PEFT layout; {extra.note})"
        model = merge_lora(model)  # LoRA adapters folded into the weights transformers reads
        dtype = None if args.save_dtype == "auto" else args.save_dtype
        shards = args.max_shard_size
        hf.save(model, args.to_hf, dtype=dtype, max_shard_size=shards, overwrite=True, extra_files=extra.files)
    note = ", LoRA adapters merged" if merged else ""
    return f"{args.checkpoint} -> {args.to_hf} ({dtype or model.config.param_dtype}{note}; {extra.note})"


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
