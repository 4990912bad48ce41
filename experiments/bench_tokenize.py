"""Tokenising a large chat JSONL file: time and peak memory of the streaming pass, then of the cached run.

    python -m experiments.bench_tokenize --megabytes 1024          # 1 GB of JSONL, the figure in the notes
    python -m experiments.bench_tokenize --megabytes 50 --tokenizer DIR

Writes a JSONL file of synthetic multi-turn tool-use conversations of the given size into ``--work-dir``,
trains a byte-level BPE tokenizer of 8,192 ids on a sample (unless ``--tokenizer`` names one) with a
ChatML template, and runs ``eqmoe.data.tokenize_file`` twice, each in a fresh process (the same call
``experiments.sft --data`` makes): the first tokenises and fills the cache, the second finds it. Prints
wall seconds, MB/s and the peak resident memory of each process, and the file and token counts.
"""

import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

from experiments.options import TokenizerOption

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "on",
    "be",
    "by",
    "at",
    "this",
    "had",
    "not",
    "are",
    "but",
    "from",
    "or",
    "have",
    "an",
    "they",
    "which",
    "one",
    "you",
    "were",
    "her",
    "all",
    "she",
    "there",
    "would",
    "their",
    "we",
    "him",
    "been",
    "has",
    "when",
    "who",
    "will",
    "more",
    "no",
    "if",
    "out",
    "so",
    "said",
    "what",
    "up",
    "its",
    "about",
    "into",
    "than",
    "them",
    "can",
    "only",
    "other",
    "new",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "my",
    "now",
    "such",
    "like",
    "our",
    "over",
    "weather",
    "city",
    "forecast",
    "temperature",
    "rain",
    "sun",
    "wind",
    "degrees",
    "tomorrow",
    "today",
    "paris",
    "tokyo",
    "berlin",
    "lima",
    "cairo",
]


@dataclass(frozen=True)
class Args(TokenizerOption):
    megabytes: int = 1024
    """Size of the JSONL file to tokenise."""
    work_dir: Path = Path("runs/bench_tokenize")
    """Where the data file, the tokenizer and the cache go (the file is reused when it has the right size)."""


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def _conversation(rng: random.Random) -> dict:
    city = rng.choice(["Paris", "Tokyo", "Berlin", "Lima", "Cairo"])
    messages = [{"role": "system", "content": _sentence(rng, 20)}]
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": " ".join(_sentence(rng, 15) for _ in range(rng.randint(1, 6)))})
        if rng.random() < 0.3:
            call = {"name": "get_weather", "arguments": {"city": city}}
            messages.append(
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}
            )
            messages.append({"role": "tool", "content": json.dumps({"city": city, "temp": rng.randint(-5, 35)})})
        answer = " ".join(_sentence(rng, 12) for _ in range(rng.randint(1, 8)))
        messages.append({"role": "assistant", "content": answer, "reasoning_content": _sentence(rng, 10)})
    return {"messages": messages}


def write_data(path: Path, megabytes: int) -> None:
    target = megabytes * 2**20
    if path.is_file() and abs(path.stat().st_size - target) < 2**20:
        return
    rng = random.Random(0)
    scratch = path.with_suffix(".partial")
    with open(scratch, "w") as handle:
        while handle.tell() < target:
            handle.write(json.dumps(_conversation(rng)) + "\n")
    scratch.rename(path)


def write_tokenizer(folder: Path, data: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from eqmoe.data import CHATML

    if (folder / "tokenizer.json").is_file():
        return
    folder.mkdir(parents=True, exist_ok=True)
    with open(data) as handle:
        sample = [next(handle) for _ in range(2000)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=8192, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=specials
    )
    tokenizer.train_from_iterator(sample, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


_CHILD = """
import json, resource, sys, time
from eqmoe.data import load_tokenizer, tokenize_file
start = time.perf_counter()
result = tokenize_file(sys.argv[1], load_tokenizer(sys.argv[2]), cache_dir=sys.argv[3])
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "cached": result.cached, "conversations": len(result),
                  "tokens": int(result.starts[-1]), "trained": int(result.loss_mask.sum()),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main(args: Args) -> int:
    args.work_dir.mkdir(parents=True, exist_ok=True)
    data = args.work_dir / f"chats-{args.megabytes}mb.jsonl"
    write_data(data, args.megabytes)
    tokenizer = args.tokenizer or args.work_dir / "tokenizer"
    if args.tokenizer is None:
        write_tokenizer(tokenizer, data)
    cache = args.work_dir / "cache"
    size_mb = data.stat().st_size / 2**20
    print(f"{data}: {size_mb:,.0f} MB; tokenizer {tokenizer}; cache {cache}")
    for attempt in ("first run", "second run"):
        start = time.perf_counter()
        output = subprocess.run(
            [sys.executable, "-c", _CHILD, str(data), str(tokenizer), str(cache)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        result = json.loads(output.strip().splitlines()[-1])
        wall = time.perf_counter() - start
        print(
            f"{attempt}: {result['seconds']:.1f} s in tokenize_file ({wall:.1f} s with start-up), "
            f"{size_mb / result['seconds']:,.1f} MB/s, peak RSS {result['peak_rss_mb']:,.0f} MB, "
            f"cached={result['cached']}; {result['conversations']:,} conversations, {result['tokens']:,} tokens, "
            f"{result['trained']:,} trained"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
