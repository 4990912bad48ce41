"""Generate text from a model with the KV-cache decoder in ``eqmoe.inference``.

    python -m experiments.generate --hf path/to/Qwen3-30B-A3B --prompt "The capital of France is"
    python -m experiments.generate --hf runs/demo/hf --prompt "1 2 3" --max-new-tokens 16 --temperature 0.7 \\
        --top-p 0.9 --seed 1 --tokenizer path/to/tokenizer.json
    python -m experiments.generate --checkpoint runs/sft/checkpoints --chat --prompt "What is 2+3?"
    python -m experiments.generate --hf DIR --messages chat.json --template-var enable_thinking=false

With ``--checkpoint`` (an eqmoe checkpoint from ``experiments.convert``, or a training run's ``checkpoints``
folder) the tokenizer defaults to the checkpoint folder's tokenizer.json or tiktoken.model, else the one the run
recorded (with the chat template and template variables it trained with), else eqmoe's byte tokenizer when the run
trained on bytes.

``--chat`` (or ``--messages FILE``, a JSON list of messages or ``{"messages", "tools"}``) builds the prompt with
the tokenizer's chat template and its generation prompt, as ``apply_chat_template(add_generation_prompt=True)``
does, and stops on the tokens the template ends a reply with as well as the eos ids (for gpt-oss's harmony
format ``<|return|>`` and ``<|call|>``, not the ``<|end|>`` between its analysis and its final answer). Without it
``--prompt`` is plain text.

Prints the prompt and its continuation as one decoded text on stdout (``--json``: an object with the prompt
ids, the new ids and the texts), and one line of timing on stderr. Greedy unless ``--temperature`` is above
0. Decoding stops at ``--eos-id`` (by default every ``eos_token_id`` of the folder's
``generation_config.json`` or ``config.json``, when there is one). Any problem with the inputs is one line on
stderr and exit code 2.
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
from eqmoe.checkpoints.source import load_source, source_tokenizer
from eqmoe.data import ByteTokenizer, Conversation, HFTokenizer, check_conversation, end_of_turn_ids, prompt_ids
from eqmoe.inference import generate
from eqmoe.model import Transformer
from experiments._cli import UsageError, guarded
from experiments.options import DtypeOption, JsonOptions, MeshOptions, ModelSourceOptions, TokenizerOptions


@dataclass(frozen=True)
class Args(ModelSourceOptions, TokenizerOptions, DtypeOption, MeshOptions, JsonOptions):
    prompt: str = ""
    """Text to continue (with --chat: the user's message)."""

    chat: bool = False
    """Render --prompt as a user message with the chat template and its generation prompt."""

    system: str | None = None
    """With --chat: a system message before the user's."""

    messages: Path | None = None
    """A JSON file holding the conversation to answer (a list of messages, or {"messages", "tools"})."""

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


def _is_chat(args: Args) -> bool:
    return args.chat or args.messages is not None


def load_model(args: Args) -> tuple[Transformer, Path, HFTokenizer | ByteTokenizer]:
    """The model to generate with, the folder its generation settings sit in, and its tokenizer."""
    source = load_source(
        hf_folder=args.hf, checkpoint=args.checkpoint, step=args.step, base=args.base, dtype=args.dtype
    )
    tokenizer = source_tokenizer(
        source,
        args.tokenizer,
        chat=_is_chat(args),
        chat_template=args.chat_template,
        template_vars=args.variables(),
    )
    return source.model, source.folder, tokenizer


def default_eos_ids(folder: Path) -> list[int]:
    """Every ``eos_token_id`` of ``generation_config.json``, else of ``config.json`` (one id or a list)."""
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((folder / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        values = value if isinstance(value, list) else [value]
        ids = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        if ids:
            return ids
    return []


def stop_ids(args: Args, folder: Path, tokenizer: HFTokenizer | ByteTokenizer) -> list[int]:
    """The ids a row stops on: ``--eos-id`` or the folder's eos ids and, with a chat, every token the template
    ends a reply with (``<|im_end|>``; harmony's ``<|return|>`` and ``<|call|>``, never its ``<|end|>``, which
    closes the analysis before the final answer of the same reply)."""
    eos_ids = [args.eos_id] if args.eos_id is not None else default_eos_ids(folder)
    if _is_chat(args):
        eos_ids = list(dict.fromkeys([*end_of_turn_ids(tokenizer), *eos_ids]))
    return eos_ids


def _conversation(args: Args) -> Conversation:
    if args.messages is not None:
        try:
            value = json.loads(args.messages.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise UsageError(f"{args.messages}: cannot read a JSON conversation ({error})") from None
        if isinstance(value, dict):
            return check_conversation(value.get("messages"), value.get("tools"), where=str(args.messages))
        return check_conversation(value, where=str(args.messages))
    if not args.prompt:
        raise UsageError("--chat needs --prompt TEXT (the user's message)")
    system = [{"role": "system", "content": args.system}] if args.system else []
    return check_conversation([*system, {"role": "user", "content": args.prompt}])


def run(args: Args) -> dict:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    if args.temperature < 0:
        raise UsageError(f"--temperature {args.temperature}: must be >= 0 (0 is greedy)")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p {args.top_p}: must be in (0, 1]")
    if args.dtype not in ("float32", "bfloat16", "float16"):
        raise UsageError(f"--dtype {args.dtype}: allowed: float32 | bfloat16 | float16")
    if not _is_chat(args) and not args.prompt:
        raise UsageError("give --prompt TEXT (or --chat / --messages FILE)")
    model, folder, tokenizer = load_model(args)
    chat = _is_chat(args)
    ids = prompt_ids(_conversation(args), tokenizer).tolist() if chat else tokenizer.encode(args.prompt)
    vocab = model.config.vocab_size
    if not ids:
        raise UsageError("the prompt is empty after tokenization")
    if max(ids) >= vocab:
        raise UsageError(f"the tokenizer produced id {max(ids)} but the model's vocabulary has {vocab} entries")
    eos_ids = stop_ids(args, folder, tokenizer)
    for eos_id in eos_ids:
        if not 0 <= eos_id < vocab:
            raise UsageError(f"--eos-id {eos_id}: outside the vocabulary 0..{vocab - 1}")

    parallelism = args.build()
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
            eos_id=eos_ids or None,
            vocab_limit=min(tokenizer.vocab_size, vocab),
        )
    row = [int(t) for t in parallel.to_host(tokens)[0]]
    seconds = time.perf_counter() - start
    new = row[len(ids) :]
    stop = next((i for i, token in enumerate(new) if token in eos_ids), None)
    new = new if stop is None else new[: stop + 1]
    print(f"generate: {len(new)} new tokens in {seconds:.2f}s (compilation included)", file=sys.stderr)
    return {
        "prompt_ids": ids,
        "new_ids": new,
        "prompt": tokenizer.decode(ids),
        "completion": tokenizer.decode(new),
        "text": tokenizer.decode(ids + new),
    }


def main(args: Args) -> int:
    result = guarded("generate", run, args)
    if result is None:
        return 2
    print(json.dumps(result, ensure_ascii=False) if args.json else result["text"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
