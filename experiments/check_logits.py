"""Check eqmoe's logits against Hugging Face transformers on the same token ids.

    python -m experiments.check_logits --hf DIR                          # convert DIR on the fly
    python -m experiments.check_logits --hf Qwen/Qwen3-30B-A3B           # a Hub id, via the HF cache
    python -m experiments.check_logits --hf DIR --candidate FINETUNED    # an eqmoe-exported folder vs DIR
    python -m experiments.check_logits --hf DIR --checkpoint CKPT        # an eqmoe checkpoint (convert, sft)
    python -m experiments.check_logits --hf DIR --dtype bfloat16 --max-kl 0.015
    python -m experiments.check_logits --hf BASE --peft ADAPTERS --checkpoint LORA_RUN/checkpoints

transformers (torch, eager attention and experts) runs the ``--hf`` folder; eqmoe runs ``--checkpoint``
(an eqmoe checkpoint, e.g. from ``experiments.convert`` or an SFT run's ``checkpoints`` folder) or
``--candidate`` (a Hugging Face folder), by default the ``--hf`` folder converted on the fly. With ``--peft``
transformers runs ``--hf`` with that PEFT adapter folder on it (``convert --adapter-only`` writes one), the
reference for a LoRA run's checkpoint, which eqmoe runs with its adapters unmerged. For each
prompt it prints the top-k overlap, Jaccard and rank agreement at the last position and the per-position
KL(P_hf || Q_eqmoe), mean and max, and it exits with status 1 when any max KL exceeds ``--max-kl``.
Prompts are text when a tokenizer is found (``--tokenizer``, else ``DIR``'s ``tokenizer.json`` or ``tiktoken.model``),
otherwise fixed pseudo-random token ids.
"""

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import tyro

from eqmoe.analysis.logits import compare_logits
from eqmoe.checkpoints import hf
from eqmoe.checkpoints.source import load_source
from eqmoe.data import HFTokenizer
from eqmoe.data.hub import resolve_folder
from eqmoe.data.tokenizer import TOKENIZER_FILE_NAMES, tokenizer_file
from experiments.options import DtypeOption, ModelSourceOptions, TokenizerOption

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Mixture-of-Experts models route each token to",
)


@dataclass(frozen=True)
class Args(ModelSourceOptions, TokenizerOption, DtypeOption):
    candidate: Path | None = None
    """Hugging Face folder or Hub id ORG/NAME[@REVISION] eqmoe runs (default: --hf, converted on the fly), e.g. one
    exported after fine-tuning."""
    peft: Path | None = None
    """PEFT adapter folder or Hub id ORG/NAME[@REVISION] that transformers puts on --hf (needs peft)."""
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    """Text prompts (used when a tokenizer is available)."""
    random_prompts: int = 3
    """Without a tokenizer: how many pseudo-random prompts of --random-length ids."""
    random_length: int = 24
    """Without a tokenizer: tokens per pseudo-random prompt."""
    max_kl: float = 1e-6
    """Fail (exit 1) when any prompt's max per-position KL exceeds this."""
    top_k: int = 10
    """k of the top-k diagnostics."""


def _with_hub_ids_resolved(args: Args) -> Args:
    """``args`` with each Hub id ``ORG/NAME[@REVISION]`` replaced by its snapshot folder in the Hugging Face cache,
    so that transformers and eqmoe read the same files."""
    named = {name: getattr(args, name) for name in ("hf", "candidate", "peft")}
    folders = {name: resolve_folder(value) for name, value in named.items() if value is not None}
    tokenizer = None if args.tokenizer is None else resolve_folder(args.tokenizer, files="tokenizer")
    return dataclasses.replace(args, **folders, tokenizer=tokenizer)


def _tokenizer_path(args: Args) -> Path | None:
    """The tokenizer file the prompts are encoded with: ``--tokenizer`` (a folder: its ``tokenizer.json``, else its
    ``tiktoken.model``), else ``--hf``'s own; ``None`` when ``--hf`` has none. ``FileNotFoundError`` in one line
    when ``--tokenizer`` names none."""
    if args.tokenizer is None:
        return tokenizer_file(args.hf)
    if args.tokenizer.is_dir():
        found = tokenizer_file(args.tokenizer)
        if found is None:
            looked = " and ".join(TOKENIZER_FILE_NAMES)
            raise FileNotFoundError(f"{args.tokenizer}: no tokenizer in this folder (looked for {looked})")
        return found
    if not args.tokenizer.is_file():
        raise FileNotFoundError(f"{args.tokenizer}: tokenizer file not found")
    return args.tokenizer


def _prompt_ids(args: Args, vocab_size: int) -> list[np.ndarray]:
    path = _tokenizer_path(args)
    if path is not None:
        tokenizer = HFTokenizer.from_file(path, chat=False)
        prompts = [np.asarray(tokenizer.encode(text), np.int64) for text in args.prompts]
        for text, ids in zip(args.prompts, prompts, strict=True):
            if len(ids) == 0 or ids.max() >= vocab_size:
                raise ValueError(f"{path}: prompt {text!r} encodes to ids outside the model's vocabulary {vocab_size}")
        return prompts
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab_size, args.random_length) for _ in range(args.random_prompts)]


def _with_peft_adapters(reference, folder: Path):
    """``reference`` with the LoRA adapters of a PEFT folder, read from ``adapter_model.safetensors`` only (never
    a pickled ``adapter_model.bin``, which PEFT's own loader falls back to)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    weights, config_file = folder / "adapter_model.safetensors", folder / "adapter_config.json"
    for path in (config_file, weights):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: not found (--peft needs a safetensors PEFT adapter folder)")
    fields = json.loads(config_file.read_text())
    if fields.get("peft_type") != "LORA":
        raise ValueError(f"{config_file}: peft_type {fields.get('peft_type')!r} is not LORA")
    config = LoraConfig(**{k: v for k, v in fields.items() if k in LoraConfig.__dataclass_fields__})
    model = get_peft_model(reference, config)
    result = set_peft_model_state_dict(model, load_file(weights))
    missing = [key for key in result.missing_keys if "lora_" in key]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{weights}: does not fit the model (missing {missing[:3]}, unexpected {result.unexpected_keys[:3]})"
        )
    return model.eval()


def main(args: Args) -> int:
    try:
        import torch
        import transformers
    except ImportError:
        print("check_logits: needs torch and transformers (pip install -e '.[test]')", file=sys.stderr)
        return 2
    try:
        if args.hf is None:
            raise ValueError("--hf: the Hugging Face model transformers runs as the reference is required")
        args = _with_hub_ids_resolved(args)
        if not (args.hf / "config.json").is_file():
            raise FileNotFoundError(f"{args.hf}: no config.json (not a Hugging Face model folder)")
        if args.candidate is not None and args.checkpoint is not None:
            raise ValueError("give --candidate or --checkpoint, not both")
        candidate = None if args.checkpoint is not None else (args.candidate or args.hf)
        model = load_source(
            hf_folder=candidate, checkpoint=args.checkpoint, step=args.step, base=args.base, dtype=args.dtype
        ).model
        expected = hf.read_config(args.hf).vocab_size
        if model.config.vocab_size != expected:
            source = args.checkpoint or candidate
            raise ValueError(f"{source}: vocabulary of {model.config.vocab_size} ids, but {args.hf} has {expected}")
        prompts = _prompt_ids(args, model.config.vocab_size)
    except (ValueError, FileNotFoundError) as error:
        print(f"check_logits: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        args.hf,
        dtype=getattr(torch, args.dtype),
        attn_implementation="eager",
        experts_implementation="eager",
        use_safetensors=True,  # never torch.load (pickle) a pytorch_model.bin found beside the weights
        trust_remote_code=False,
    ).eval()
    if args.peft is not None:
        try:
            reference = _with_peft_adapters(reference, args.peft)
        except ImportError:
            print("check_logits: --peft needs peft (pip install -e '.[test]')", file=sys.stderr)
            return 2
        except (ValueError, FileNotFoundError) as error:
            print(f"check_logits: {' '.join(str(error).split())}", file=sys.stderr)
            return 2
    forward = eqx.filter_jit(lambda model, ids: model(ids).logits)
    worst = 0.0
    print(f"{'prompt':>6}  {'tokens':>6}  {'KL mean':>10}  {'KL max':>10}  overlap  jaccard  rank agree  max|diff|")
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            expected = reference(torch.tensor(ids[None])).logits[0].float().numpy()
        logits = np.asarray(forward(model, jnp.asarray(ids[None], jnp.int32))[0].astype(jnp.float32))
        result = compare_logits(expected, logits, args.top_k)
        worst = max(worst, result.kl_max)
        print(
            f"{i:>6}  {len(ids):>6}  {result.kl_mean:>10.3e}  {result.kl_max:>10.3e}  "
            f"{result.top_k_overlap:>4}/{args.top_k:<2}  {result.jaccard:>7.3f}  {result.rank_agreement:>10.2f}  "
            f"{result.max_abs_difference:.3e}"
        )
    verdict = "PASS" if worst <= args.max_kl else "FAIL"
    print(f"{verdict}: max KL {worst:.3e} (threshold {args.max_kl:.1e})")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
