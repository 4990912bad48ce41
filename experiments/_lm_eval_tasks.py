"""Local lm-evaluation-harness tasks over data written on the spot (a multiple-choice task, a generation task, a
perplexity task), for the tests and ``bench_evaluate``: nothing comes from the network. Pass the folder as lm-eval's
include path (``--include-path``)."""

import json
import random
from pathlib import Path

WORDS = "the weather in Paris is sunny cold warm degrees what plus and reverse sort small first tool call".split()  # noqa: SIM905
TASKS = ("eqmoe_test_mc", "eqmoe_test_gen", "eqmoe_test_ppl")
FILES = ("mc", "gen", "ppl")  # the JSONL data of TASKS, in order, in the task folder


def _rows(count: int, seed: int, longest: int = 9) -> list[list[str]]:
    rng = random.Random(seed)
    return [[rng.choice(WORDS) for _ in range(rng.randint(3, longest))] for _ in range(count)]


def write_tasks(
    folder: Path, *, items: int = 12, documents: int = 4, document_words: int = 60, max_gen_toks: int = 10
) -> Path:
    """Task YAMLs and their JSONL data in ``folder`` (pass it as lm-eval's include path); returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    mc = [
        {"question": " ".join(words) + " is", "choices": [" warm", " cold", " sunny degrees"], "answer": i % 3}
        for i, words in enumerate(_rows(items, 1, longest=30))
    ]
    gen = [{"prompt": " ".join(words), "target": words[-1]} for words in _rows(items, 2, longest=20)]
    ppl = [{"text": " ".join(w for row in _rows(document_words // 5, 3 + i) for w in row)} for i in range(documents)]
    for name, rows in (("mc", mc), ("gen", gen), ("ppl", ppl)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = "dataset_path: json\ntest_split: train\nmetadata:\n  version: 1.0\n"
    data = "dataset_kwargs:\n  data_files:\n    train: {}\n"
    (folder / "mc.yaml").write_text(
        f"task: eqmoe_test_mc\n{common}{data.format(folder / 'mc.jsonl')}output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (folder / "gen.yaml").write_text(
        f"task: eqmoe_test_gen\n{common}{data.format(folder / 'gen.jsonl')}output_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
        f'generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: {max_gen_toks}\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    (folder / "ppl.yaml").write_text(
        f"task: eqmoe_test_ppl\n{common}{data.format(folder / 'ppl.jsonl')}output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    return folder
