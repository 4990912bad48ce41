"""Generate text from a model with the KV-cache decoder in ``eqmoe.inference``.

    python -m experiments.generate --hf path/to/Qwen3-30B-A3B --prompt "The capital of France is"
    python -m experiments.generate --hf runs/demo/hf --prompt "1 2 3" --max-new-tokens 16 --temperature 0.7 \\
        --top-p 0.9 --seed 1 --tokenizer path/to/tokenizer.json
    python -m experiments.generate --checkpoint runs/sft/checkpoints --prompt "<|im_start|>user..."

With ``--checkpoint`` (an eqmoe checkpoint from ``experiments.convert``, or a training run's ``checkpoints``
folder) the tokenizer defaults to the checkpoint folder's tokenizer.json, else the one the run recorded,
else eqmoe's byte tokenizer when the run trained on bytes.

Prints the prompt and its continuation as one decoded text on stdout, and one line of timing on
stderr. Greedy unless ``--temperature`` is above 0. Decoding stops at ``--eos-id`` (by default the
``eos_token_id`` of the folder's ``generation_config.json`` or ``config.json``, when there is one).
Any problem with the inputs is one line on stderr and exit code 2.
"""

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import tyro

from eqmoe import parallel
from eqmoe.data import ByteTokenizer, HFTokenizer
from eqmoe.inference import generate
from eqmoe.model import Transformer
from experiments._cli import MeshOptions, UsageError, guarded


@dataclass(frozen=True)
class Args:
    prompt: str
    """Text to continue."""

    hf: Path | None = None
    """Hugging Face model folder (config.json + safetensors), read with eqmoe.checkpoints.hf.load."""

    checkpoint: Path | None = None
    """eqmoe checkpoint folder (experiments.convert output, or a training run's checkpoints folder)."""

    step: int | None = None
    """With --checkpoint: the step to load (default: the latest)."""

    tokenizer: Path | None = None
    """tokenizer.json to encode and decode with (default: tokenizer.json in the --hf folder)."""

    max_new_tokens: int = 32
    """Tokens to generate after the prompt."""

    temperature: float = 0.0
    """Sampling temperature; 0 is greedy decoding."""

    top_p: float = 1.0
    """Nucleus sampling: sample among the most probable tokens holding this much probability."""

    seed: int = 0
    """Seed of the sampling PRNG key (unused when greedy)."""

    eos_id: int | None = None
    """Token id that ends a row (default: eos_token_id from the folder's generation_config.json or config.json)."""

    dtype: str = "float32"
    """Parameter and compute dtype: float32 | bfloat16 | float16."""

    mesh: str | None = None
    """Device mesh to shard the model over, e.g. expert=4 or tensor=2 (default: one device)."""

    rules: str = ""
    """Logical-axis rule overrides (see eqmoe.parallel.DEFAULT_RULES)."""


def _tokenizer(path: Path) -> HFTokenizer:
    """A Hugging Face tokenizer.json for plain text, special tokens included as written in the prompt."""
    if not path.is_file():
        raise UsageError(f"{path}: tokenizer not found (pass --tokenizer path/to/tokenizer.json)")
    return HFTokenizer.from_file(path, chat=False)


def load_model(args: Args) -> tuple[Transformer, Path, HFTokenizer | ByteTokenizer]:
    """The model to generate with, the folder its generation settings sit in, and its tokenizer."""
    if (args.hf is None) == (args.checkpoint is None):
        raise UsageError("give one of --hf DIR (a Hugging Face folder) or --checkpoint DIR (an eqmoe checkpoint)")
    folder = args.hf or args.checkpoint
    if not folder.is_dir():
        raise UsageError(f"{folder}: model folder not found")
    if args.hf is not None:
        from eqmoe.checkpoints import hf

        model, recorded = hf.load(args.hf, dtype=args.dtype), {}
    else:
        from eqmoe.checkpoints.model_checkpoint import load_model as load_checkpoint

        model, recorded = load_checkpoint(args.checkpoint, step=args.step, dtype=args.dtype)
    if args.tokenizer is not None or (folder / "tokenizer.json").is_file():
        return model, folder, _tokenizer(args.tokenizer or folder / "tokenizer.json")
    if recorded.get("tokenizer") is None and "tokenizer" in recorded:  # the run trained on bytes
        return model, folder, ByteTokenizer()
    if isinstance(recorded.get("tokenizer"), str):
        return model, folder, _tokenizer(Path(recorded["tokenizer"]))
    raise UsageError(f"{folder}: no tokenizer.json (pass --tokenizer path/to/tokenizer.json)")


def default_eos_id(folder: Path) -> int | None:
    """``eos_token_id`` of ``generation_config.json`` or ``config.json`` (the first of a list)."""
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((folder / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def run(args: Args) -> str:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    if args.temperature < 0:
        raise UsageError(f"--temperature {args.temperature}: must be >= 0 (0 is greedy)")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p {args.top_p}: must be in (0, 1]")
    if args.dtype not in ("float32", "bfloat16", "float16"):
        raise UsageError(f"--dtype {args.dtype}: allowed: float32 | bfloat16 | float16")
    model, folder, tokenizer = load_model(args)
    ids = tokenizer.encode(args.prompt)
    vocab = model.config.vocab_size
    if not ids:
        raise UsageError("the prompt is empty after tokenization")
    if max(ids) >= vocab:
        raise UsageError(f"the tokenizer produced id {max(ids)} but the model's vocabulary has {vocab} entries")
    eos_id = args.eos_id if args.eos_id is not None else default_eos_id(folder)
    if eos_id is not None and not 0 <= eos_id < vocab:
        raise UsageError(f"--eos-id {eos_id}: outside the vocabulary 0..{vocab - 1}")

    parallelism = MeshOptions(mesh=args.mesh, rules=args.rules).build()
    model = parallel.shard(model, parallelism)
    start = time.perf_counter()
    with parallel.activate(parallelism):
        tokens = generate(
            model,
            jnp.asarray([ids], jnp.int32),
            max_new_tokens=args.max_new_tokens,
            key=jax.random.key(args.seed),
            temperature=args.temperature,
            top_p=args.top_p,
            eos_id=eos_id,
            vocab_limit=min(tokenizer.vocab_size, vocab),
        )
    row = [int(t) for t in parallel.to_host(tokens)[0]]
    seconds = time.perf_counter() - start
    new = row[len(ids) :]
    if eos_id is not None and eos_id in new:
        new = new[: new.index(eos_id) + 1]
    print(f"generate: {len(new)} new tokens in {seconds:.2f}s (compilation included)", file=sys.stderr)
    return tokenizer.decode(ids + new)


def main(args: Args) -> int:
    text = guarded("generate", run, args)
    if text is None:
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
