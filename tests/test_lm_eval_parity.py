"""eqmoe's lm-eval model against lm-eval's own transformers backend (``--model hf``) on the same exported folder and
the same local tasks: per-request log-likelihoods within 1e-4 (float32) with the same greedy flags and accuracy,
identical generated text, perplexities within 1e-4 relative. The maximum length is short enough that contexts are cut
from the left, prompts are cut to leave room for ``max_gen_toks`` and documents span several rolling windows."""

import json

import numpy as np
import pytest
from lm_eval_fixtures import TASKS, write_model_folder, write_tasks

from experiments._lm_eval_tasks import FILES

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from lm_eval.tasks import TaskManager  # noqa: E402

from eqmoe.data import load_tokenizer  # noqa: E402
from eqmoe.evaluation.lm_eval_model import EqmoeLM  # noqa: E402

MAX_LENGTH = 24


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    folder = write_model_folder(root / "hf")
    tasks = write_tasks(root / "tasks", items=8, documents=3)
    _check_the_cases_are_there(folder, tasks)
    manager = TaskManager(include_path=str(tasks), include_defaults=False)  # not lm-eval's own thousands: 7 s
    common = dict(tasks=list(TASKS), task_manager=manager, log_samples=True, verbosity="ERROR")
    reference = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={folder},dtype=float32,max_length={MAX_LENGTH}",
        device="cpu",
        batch_size=32,
        **common,
    )
    ours = lm_eval.simple_evaluate(model=EqmoeLM(hf=str(folder), max_length=MAX_LENGTH, batch_size=32), **common)
    return reference, ours


def _check_the_cases_are_there(folder, tasks):
    """Some contexts are cut from the left, some prompts are cut for max_gen_toks, every document spans windows."""
    tokenizer = load_tokenizer(folder, chat=False)
    rows = {name: [json.loads(line) for line in (tasks / f"{name}.jsonl").read_text().splitlines()] for name in FILES}
    longest_mc = max(len(tokenizer.encode(r["question"] + c)) for r in rows["mc"] for c in r["choices"])
    longest_prompt = max(len(tokenizer.encode(r["prompt"])) for r in rows["gen"])
    shortest_document = min(len(tokenizer.encode(r["text"])) for r in rows["ppl"])
    assert longest_mc > MAX_LENGTH + 1 and longest_prompt > MAX_LENGTH - 10 and shortest_document > 2 * MAX_LENGTH


def _responses(result, task):
    return [sample["resps"] for sample in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def test_loglikelihoods_choices_and_accuracy_match_transformers(results):
    reference, ours = results
    theirs, mine = _responses(reference, "eqmoe_test_mc"), _responses(ours, "eqmoe_test_mc")
    assert len(theirs) == len(mine) == 8
    for expected, got in zip(theirs, mine, strict=True):
        np.testing.assert_allclose([r[0][0] for r in got], [r[0][0] for r in expected], atol=1e-4, rtol=0)
        assert [r[0][1] for r in got] == [r[0][1] for r in expected]
        assert np.argmax([r[0][0] for r in got]) == np.argmax([r[0][0] for r in expected])
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["eqmoe_test_mc"][metric] == reference["results"]["eqmoe_test_mc"][metric]


def test_greedy_generations_match_transformers(results):
    reference, ours = results
    theirs, mine = _responses(reference, "eqmoe_test_gen"), _responses(ours, "eqmoe_test_gen")
    assert mine == theirs
    assert any(text[0] for text in mine)  # something was generated
    metric = "exact_match,none"
    assert ours["results"]["eqmoe_test_gen"][metric] == reference["results"]["eqmoe_test_gen"][metric]


def test_rolling_perplexity_matches_transformers(results):
    reference, ours = results
    theirs, mine = _responses(reference, "eqmoe_test_ppl"), _responses(ours, "eqmoe_test_ppl")
    np.testing.assert_allclose([r[0] for r in mine], [r[0] for r in theirs], rtol=1e-4)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        expected = reference["results"]["eqmoe_test_ppl"][metric]
        assert ours["results"]["eqmoe_test_ppl"][metric] == pytest.approx(expected, rel=1e-4)


def test_the_chat_template_renders_few_shot_turns_as_transformers_does(tmp_path):
    from chat_fixtures import TEMPLATES
    from transformers import AutoTokenizer

    folder = write_model_folder(tmp_path / "hf", template=(TEMPLATES / "qwen3.jinja").read_text())
    history = [  # what lm-eval builds with --apply_chat_template --fewshot_as_multiturn
        {"role": "system", "content": "Answer with one word."},
        {"role": "user", "content": "the weather in Paris is"},
        {"role": "assistant", "content": "sunny"},
        {"role": "user", "content": "what plus and"},
    ]
    ours = EqmoeLM(hf=str(folder)).apply_chat_template(history)
    reference = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        history, tokenize=False, add_generation_prompt=True
    )
    assert ours == reference
