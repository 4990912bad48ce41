"""Every notebook runs top to bottom without an error, and none is committed with outputs."""

import json
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from experiments import ablate

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_notebooks_exist():
    assert [p.stem for p in NOTEBOOKS] == [
        "01_quickstart",
        "02_routing_explorer",
        "03_qwen3_parity",
        "04_envy_two_readings",
        "05_ablation_results",
        "06_fine_tune_a_checkpoint",
        "06_published_findings",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip outputs before committing"


# -m slow (125 s): the Envy readings notebook (its numbers are tests/test_envy.py's), the routing explorer (its
# analyses are tests/test_routing_analyses.py's), the fine-tuning walk-through (its LoRA run and both exports are
# tests/test_lora_sft.py's, its chat data tests/test_chat_data.py's) and the Qwen3 parity notebook (its logits are
# tests/test_qwen3_parity.py's and tests/test_hf_roundtrip.py's); the other three run by default.
SLOW_NOTEBOOKS = ("02_routing_explorer", "03_qwen3_parity", "04_envy_two_readings", "06_fine_tune_a_checkpoint")


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=pytest.mark.slow) if p.stem in SLOW_NOTEBOOKS else p for p in NOTEBOOKS],
    ids=[p.stem for p in NOTEBOOKS],
)
def test_notebook_runs_top_to_bottom(path):
    notebook = nbformat.read(path, as_version=4)
    started = time.perf_counter()
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    figures = sum(
        "image/png" in output.get("data", {}) for cell in notebook.cells for output in cell.get("outputs", [])
    )
    assert figures >= 1, f"{path.name} drew no figure"
    assert time.perf_counter() - started < 120, f"{path.name} took more than two minutes"


def test_the_committed_ablation_results_are_of_the_current_default_grid():
    """05 plots committed results; they must be what ``python -m experiments.ablate`` now runs."""
    results = json.loads((ROOT / "notebooks" / "data" / "ablate_default_grid.json").read_text())
    stale = "re-run `python -m experiments.ablate` and copy runs/ablate/results.json to notebooks/data/"
    assert results["settings"] == ablate.settings(ablate.Args()), stale
    assert results["base_overrides"] == ablate.BASE_OVERRIDES, stale
    assert {name: row["overrides"] for name, row in results["variants"].items()} == ablate.VARIANTS, stale
