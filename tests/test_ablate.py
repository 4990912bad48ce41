"""The ablation grid: reproducible rows, skipping finished variants and resuming an interrupted one."""

import ast
import functools
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import tyro

from eqmoe import presets
from eqmoe.config_io import apply_overrides
from experiments import ablate, pretrain
from tests.conftest import kill_when

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(
    steps=24,
    batch_size=4,
    seq_len=64,
    eval_every=8,
    checkpoint_every=8,
    chars_per_domain=6_000,
    eval_chars_per_domain=1_500,
)
TINY_FLAGS = [f"--{name.replace('_', '-')}={value}" for name, value in TINY.items()]


def test_every_variant_builds_and_its_printed_command_reproduces_its_arguments(tmp_path):
    args = ablate.Args(out_dir=tmp_path, **TINY)
    for name, overrides in ablate.VARIANTS.items():
        apply_overrides(presets.get(args.preset), {**ablate.BASE_OVERRIDES, **overrides})  # valid config
        variant = ablate.pretrain_args(args, name)
        words = shlex.split(ablate.command(variant))
        assert words[:3] == ["python", "-m", "experiments.pretrain"]
        parsed = tyro.cli(pretrain.Args, args=words[3:], config=(tyro.conf.OmitArgPrefixes,))
        assert parsed == variant, name
        assert pretrain.model_config(parsed.model) == pretrain.model_config(variant.model)


def _ablate(out_dir: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "experiments.ablate", "--variants", "baseline", "--out-dir", str(out_dir)]
    return subprocess.Popen(
        [*command, *TINY_FLAGS, *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_killed_variant_resumes_and_finished_variants_are_skipped(tmp_path):
    reference = ablate.run(ablate.Args(out_dir=tmp_path / "straight", variants=("baseline",), **TINY))

    out_dir = tmp_path / "killed"
    process = _ablate(out_dir)
    kill_when(process, (out_dir / "baseline" / "checkpoints" / "8").is_dir)
    assert not (out_dir / "baseline" / "summary.json").exists()

    resumed = _ablate(out_dir)
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert "resumed from step" in err
    results = json.loads((out_dir / "results.json").read_text())
    row, expected = results["variants"]["baseline"], reference["variants"]["baseline"]
    assert row["eval_loss"] == expected["eval_loss"] and row["load_cv"] == expected["load_cv"]
    assert row["overrides"] == {} and row["all_overrides"] == ablate.BASE_OVERRIDES
    assert "python -m experiments.pretrain" in (out_dir / "results.md").read_text()

    summary = out_dir / "baseline" / "summary.json"
    written = summary.stat().st_mtime_ns
    again = ablate.run(ablate.Args(out_dir=out_dir, variants=("baseline",), **TINY))
    assert summary.stat().st_mtime_ns == written
    assert again["variants"]["baseline"]["eval_loss"] == expected["eval_loss"]
    for name in ("results.md", "eval_loss.png", "load_balance.png"):
        assert (out_dir / name).is_file()


def test_the_readme_recipe_for_a_new_variant_makes_it_runnable_by_name(tmp_path):
    """Follow README.md alone: its sentence names the dict and the file, its code block is the line to add."""
    readme = (ROOT / "README.md").read_text()
    recipe = re.search(r"add one\s+line to `(\w+)` in `([\w/.]+)`:\s*```python\n(.+?)\n```", readme, re.S)
    assert recipe, "README.md lost its recipe for adding an ablation variant"
    table, file, line = recipe.groups()
    name = re.match(r'\s*"([\w-]+)":', line).group(1)

    tree = tmp_path / "tree"
    shutil.copytree(ROOT / Path(file).parent, tree / Path(file).parent, ignore=shutil.ignore_patterns("__pycache__"))
    source = (tree / file).read_text()
    opening = re.search(rf"^{table}\b.*=\s*{{\n", source, re.M)
    assert opening, f"{file} has no `{table} = {{` for the README's line to go into"
    (tree / file).write_text(source[: opening.end()] + line + "\n" + source[opening.end() :])

    out = tmp_path / "ablate"
    flags = [*TINY_FLAGS, "--steps=4", f"--out-dir={out}"]
    module = file.removesuffix(".py").replace("/", ".")
    run = subprocess.run(
        [sys.executable, "-m", module, "--variants", name, *flags], cwd=tree, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert list(results["variants"]) == [name]
    trained = json.loads((out / name / "summary.json").read_text())["config"]
    base = presets.get("qwen3-moe-micro")
    for field, value in eval_line(line)[name].items():
        *groups, leaf = field.split(".")
        assert (
            functools.reduce(dict.__getitem__, groups, trained)[leaf]
            == value
            != functools.reduce(getattr, field.split("."), base)
        )
    assert name not in ablate.VARIANTS, "the README's example variant already exists: the recipe proves nothing"


def eval_line(line: str) -> dict:
    """The dict entry ``line`` as data (a literal, so no code runs)."""
    return ast.literal_eval("{" + line.strip().rstrip(",") + "}")


def test_unknown_variants_and_changed_settings_are_one_line_errors(tmp_path, capsys):
    assert ablate.main(ablate.Args(out_dir=tmp_path, variants=("nope",))) == 2
    assert "unknown variant(s) nope; known: baseline" in capsys.readouterr().err
    (tmp_path / "ablation.json").write_text(json.dumps({"steps": 1}))
    assert ablate.main(ablate.Args(out_dir=tmp_path, variants=("baseline",))) == 2
    assert "holds an ablation with other settings" in capsys.readouterr().err


def test_results_table_marks_missing_and_infinite_figures():
    name = "baseline"
    results = {
        "settings": ablate.settings(ablate.Args()),
        "variants": {
            name: {
                "overrides": {},
                "command": "python -m experiments.pretrain",
                "eval_loss": 1.5,
                "load_cv": 0.2,
                "max_min_ratio": float("inf"),
                "dropped_fraction": 0.0,
                "router_entropy": 0.9,
                "domain_nmi": None,
                "tokens_per_second": 100.0,
            }
        },
    }
    table = ablate.results_table(results)
    assert f"| {name} | 1.500 |  | 0.200 | inf | 0.000 | 0.900 | – | 100 |" in table
