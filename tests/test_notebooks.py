"""Every notebook runs top to bottom without an error, and none is committed with outputs."""

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_five_notebooks_exist():
    assert [p.stem for p in NOTEBOOKS] == [
        "01_quickstart",
        "02_routing_explorer",
        "03_qwen3_parity",
        "04_envy_two_readings",
        "05_ablation_results",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip outputs before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path):
    notebook = nbformat.read(path, as_version=4)
    started = time.perf_counter()
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    figures = sum(
        "image/png" in output.get("data", {}) for cell in notebook.cells for output in cell.get("outputs", [])
    )
    assert figures >= 1, f"{path.name} drew no figure"
    assert time.perf_counter() - started < 120, f"{path.name} took more than two minutes"
