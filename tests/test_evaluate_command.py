"""``experiments.evaluate`` end to end on local tasks: an eqmoe checkpoint with LoRA adapters is scored as the adapted
model, not its base (an item whose chosen answer the adapters change); a bad task name, a missing data file and a
tokenizer the model's vocabulary does not fit are one line on stderr and exit code 2, before any request runs."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tyro
from lm_eval_fixtures import write_model_folder, write_tasks

pytest.importorskip("lm_eval")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

from eqmoe.checkpoints import hf  # noqa: E402
from eqmoe.checkpoints.model_checkpoint import save_model  # noqa: E402
from eqmoe.checkpoints.run_metadata import RunMetadata  # noqa: E402
from eqmoe.lora import LoRAConfig, add_lora, has_lora  # noqa: E402
from eqmoe.nn.linear import LowRank  # noqa: E402
from experiments import evaluate  # noqa: E402

MC = "eqmoe_test_mc"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    return write_model_folder(root / "hf"), write_tasks(root / "tasks", items=8, documents=2)


def _lora_run(base, out):
    """A run's checkpoints folder holding ``base`` with rank-4 adapters whose B matrices are large and random (a
    trained LoRA run's layout: the adapters beside the base, the run's tokenizer and LoRA settings recorded)."""
    lora = LoRAConfig(rank=4, alpha=8.0, targets=("attention", "experts"))
    model = add_lora(hf.load(base), lora, key=jax.random.key(1))
    keys = iter(jax.random.split(jax.random.key(2), 1000))

    def perturbed(node):
        if isinstance(node, LowRank):
            return dataclasses.replace(node, b=0.5 * jax.random.normal(next(keys), node.b.shape, jnp.float32))
        return node

    model = jax.tree.map(perturbed, model, is_leaf=lambda node: isinstance(node, LowRank))
    metadata = RunMetadata(model.config, tokenizer=str(base / "tokenizer.json"), lora=dataclasses.asdict(lora))
    return save_model(model, out / "checkpoints", metadata=metadata)


def _choices(out_dir) -> dict[int, int]:
    rows = [json.loads(line) for line in (out_dir / "samples.jsonl").read_text().splitlines()]
    return {row["doc_id"]: int(np.argmax([r[0] for r in row["filtered_resps"]])) for row in rows if row["task"] == MC}


def test_a_lora_checkpoint_is_scored_with_its_adapters(folders, tmp_path, capsys):
    base, tasks = folders
    checkpoints = _lora_run(base, tmp_path / "run")
    common = ["--tasks", MC, "--include-path", str(tasks), "--limit", "6", "--num-fewshot", "0", "--log-samples"]
    common += ["--max-length", "32", "--eval-batch-size", "32"]  # as typed on the command line
    for model, out in ((["--hf", str(base)], "base"), (["--checkpoint", str(checkpoints)], "lora")):
        argv = [*model, *common, "--out-dir", str(tmp_path / out), "--tracker", "tensorboard"]
        assert evaluate.main(tyro.cli(evaluate.Args, args=argv)) == 0
    table = capsys.readouterr().out
    assert MC in table and "acc" in table
    before, after = _choices(tmp_path / "base"), _choices(tmp_path / "lora")
    changed = [doc for doc in before if before[doc] != after[doc]]
    assert changed, (before, after)  # on these items the base picks one answer and the adapted model another
    results = json.loads((tmp_path / "lora" / "results.json").read_text())
    assert set(results["scores"][MC]) >= {"acc", "acc_norm", "acc_stderr"}
    assert len(before) == len(after) == 6 and results["lm_eval"]["n-shot"][MC] == 0
    assert (tmp_path / "lora" / "results.md").read_text().count(MC) == 1
    events = event_accumulator.EventAccumulator(str(tmp_path / "lora" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert events.Scalars(f"lm_eval/{MC}/acc")[0].value == pytest.approx(results["scores"][MC]["acc"])
    from eqmoe.checkpoints.model_checkpoint import load_model

    assert has_lora(load_model(checkpoints)[0])


def _one_line_exit_2(capsys, args) -> str:
    assert evaluate.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_task_missing_data_and_a_misfit_tokenizer_are_one_line_and_exit_2(folders, tmp_path, capsys):
    base, tasks = folders
    err = _one_line_exit_2(capsys, evaluate.Args(hf=base, tasks=("no_such_task",), include_path=tasks))
    assert "no_such_task" in err and "unknown task" in err

    broken = tmp_path / "broken"
    broken.mkdir()
    yaml = (tasks / "mc.yaml").read_text().replace("eqmoe_test_mc", "eqmoe_test_missing")
    (broken / "missing.yaml").write_text(yaml.replace(str(tasks / "mc.jsonl"), str(broken / "gone.jsonl")))
    err = _one_line_exit_2(capsys, evaluate.Args(hf=base, tasks=("eqmoe_test_missing",), include_path=broken))
    assert "eqmoe_test_missing" in err and "gone.jsonl" in err

    small = write_model_folder(tmp_path / "small", vocab_padding=-40)
    err = _one_line_exit_2(capsys, evaluate.Args(hf=small, tasks=(MC,), include_path=tasks))
    assert "tokenizer" in err and "vocabulary" in err


def test_sft_eval_tasks_puts_the_final_models_scores_in_its_summary(folders, tmp_path):
    from experiments import sft
    from experiments.options import EvalOptions

    _, tasks = folders
    out = tmp_path / "sft"
    args = sft.Args(
        model=sft.ModelOptions(preset="qwen3-moe-micro"),
        data=sft.DataOptions(seq_len=64, batch_size=4, train_examples=40, eval_examples=4),
        run=sft.RunOptions(steps=2, out_dir=out, checkpoint_every=10, eval_every=1000, log_every=1, samples=0),
        eval=EvalOptions(eval_tasks=(MC, "eqmoe_test_ppl"), include_path=tasks, max_length=32, eval_batch_size=16),
    )
    summary = sft.run(args)
    written = json.loads((out / "summary.json").read_text())
    assert written["lm_eval"] == summary["lm_eval"]
    assert 0 <= written["lm_eval"][MC]["acc"] <= 1
    assert written["lm_eval"]["eqmoe_test_ppl"]["word_perplexity"] > 1  # the byte tokenizer the run trained with


def test_a_bad_eval_task_stops_sft_before_it_trains(folders, tmp_path, capsys):
    from experiments import sft
    from experiments.options import EvalOptions

    _, tasks = folders
    out = tmp_path / "sft"
    args = sft.Args(
        run=sft.RunOptions(steps=2, out_dir=out),
        eval=EvalOptions(eval_tasks=("no_such_task",), include_path=tasks),
    )
    assert sft.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no_such_task" in err
    assert not (out / "checkpoints").exists()


def test_without_lm_eval_the_command_names_the_install(folders, monkeypatch, capsys):
    import sys

    base, tasks = folders
    for name in [name for name in sys.modules if name == "lm_eval" or name.startswith("eqmoe.evaluation")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what an environment without the eval extra imports
    err = _one_line_exit_2(capsys, evaluate.Args(hf=base, tasks=(MC,), include_path=tasks))
    assert "pip install 'eqmoe[eval]'" in err
