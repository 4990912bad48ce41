"""lm-eval throughput of eqmoe's model against lm-eval's own transformers backend, side by side in one process.

    python -m experiments.bench_evaluate --items 128 --documents 16 --repeats 3 --json-out bench_evaluate.json

Writes a random float32 ``qwen3-moe-tiny`` (about 2M parameters) as a Hugging Face folder with a byte-level BPE
tokenizer trained on the spot, and local tasks (:mod:`experiments._lm_eval_tasks`: multiple choice, greedy generation,
rolling perplexity over documents longer than ``--context-tokens``), then runs each task on both backends
(``--model hf`` on the CPU in float32 and ``--model eqmoe``) at the same batch size. Per task and backend: the first
run (eqmoe's includes compiling its length buckets) and the median of ``--repeats`` further runs, in requests and
input tokens per second, and eqmoe's ratio to transformers.
"""

import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

from experiments._lm_eval_tasks import FILES, TASKS, WORDS, write_tasks
from experiments.options import JsonFileOptions


@dataclass(frozen=True)
class Args(JsonFileOptions):
    items: int = 128
    """Multiple-choice questions (3 requests each) and generation prompts."""
    documents: int = 16
    """Perplexity documents."""
    document_words: int = 400
    """Words per perplexity document (several windows of --context-tokens tokens each)."""
    context_tokens: int = 128
    """Longest input in tokens, lm-eval's max_length (both backends)."""
    max_gen_toks: int = 16
    """Tokens generated per prompt at most."""
    requests_per_batch: int = 32
    """Requests per batch, lm-eval's batch_size (both backends)."""
    repeats: int = 3
    """Timed runs after the first; the median is reported."""


def _write_folder(folder: Path) -> Path:
    import jax
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from eqmoe import Transformer, presets
    from eqmoe.checkpoints import hf

    scratch = folder.parent / "tokenizer"
    scratch.mkdir(parents=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]
    )
    tokenizer.train_from_iterator([" ".join(WORDS)] * 8, trainer)
    tokenizer.save(str(scratch / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
    }
    (scratch / "tokenizer_config.json").write_text(json.dumps(settings))
    config = presets.get("qwen3-moe-tiny").replace(vocab_size=tokenizer.get_vocab_size(with_added_tokens=True))
    model = Transformer(config, key=jax.random.key(0))
    return hf.save(model, folder, extra_files=[scratch / "tokenizer.json", scratch / "tokenizer_config.json"])


def _workload(tasks: Path, folder: Path) -> dict[str, tuple[int, int]]:
    """Requests and input tokens of each task (the same for both backends)."""
    from eqmoe.data import load_tokenizer

    tokenizer = load_tokenizer(folder, chat=False)
    rows = {name: [json.loads(line) for line in (tasks / f"{name}.jsonl").read_text().splitlines()] for name in FILES}
    mc = [len(tokenizer.encode(r["question"] + c)) for r in rows["mc"] for c in r["choices"]]
    gen = [len(tokenizer.encode(r["prompt"])) for r in rows["gen"]]
    ppl = [len(tokenizer.encode(r["text"])) for r in rows["ppl"]]
    return {
        "eqmoe_test_mc": (len(mc), sum(mc)),
        "eqmoe_test_gen": (len(gen), sum(gen)),
        "eqmoe_test_ppl": (len(ppl), sum(ppl)),
    }


def main(args: Args) -> dict:
    import jax
    import lm_eval
    import torch
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    from eqmoe.evaluation.lm_eval_model import EqmoeLM

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        folder = _write_folder(root / "hf")
        tasks = write_tasks(
            root / "tasks",
            items=args.items,
            documents=args.documents,
            document_words=args.document_words,
            max_gen_toks=args.max_gen_toks,
        )
        manager = TaskManager(include_path=str(tasks), include_defaults=False)
        workload = _workload(tasks, folder)
        backends = {
            "transformers": get_model("hf").create_from_arg_string(
                f"pretrained={folder},dtype=float32,max_length={args.context_tokens}",
                {"batch_size": args.requests_per_batch, "device": "cpu"},
            ),
            "eqmoe": EqmoeLM(hf=str(folder), max_length=args.context_tokens, batch_size=args.requests_per_batch),
        }
        rows = []
        for task in TASKS:
            requests, tokens = workload[task]
            for name, lm in backends.items():
                times = []
                for _ in range(1 + args.repeats):
                    start = time.perf_counter()
                    lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, verbosity="ERROR")
                    times.append(time.perf_counter() - start)
                median = statistics.median(times[1:])
                rows.append(
                    {
                        "task": task,
                        "backend": name,
                        "requests": requests,
                        "tokens": tokens,
                        "first_seconds": times[0],
                        "median_seconds": median,
                        "requests_per_second": requests / median,
                        "tokens_per_second": tokens / median,
                        "all_seconds": times,
                    }
                )
    print(
        f"\nbench_evaluate: {args.items} items, {args.documents} documents, max length {args.context_tokens}, batch "
        f"{args.requests_per_batch}; jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads); median of {args.repeats} runs after the first"
    )
    print(
        f"{'task':<16}{'backend':<14}{'requests':>9}{'tokens':>9}{'first s':>9}{'median s':>9}{'req/s':>9}"
        f"{'tok/s':>10}{'vs hf':>8}"
    )
    for row in rows:
        reference = next(r for r in rows if r["task"] == row["task"] and r["backend"] == "transformers")
        ratio = reference["median_seconds"] / row["median_seconds"]
        row["speedup_vs_transformers"] = ratio
        print(
            f"{row['task']:<16}{row['backend']:<14}{row['requests']:>9}{row['tokens']:>9}{row['first_seconds']:>9.2f}"
            f"{row['median_seconds']:>9.2f}{row['requests_per_second']:>9.1f}{row['tokens_per_second']:>10.0f}"
            f"{ratio:>7.2f}x"
        )
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(tyro.cli(Args))
