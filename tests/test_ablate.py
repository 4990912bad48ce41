"""The ablation grid: reproducible rows, skipping finished variants and resuming an interrupted one."""

import ast
import dataclasses
import functools
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import tyro

from eqmoe import presets
from eqmoe.config_io import apply_overrides
from eqmoe.nn.router import STRATEGIES
from experiments import ablate, pretrain
from experiments._cli import UsageError
from tests.chat_fixtures import write_tokenizer_folder
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


# --- your data, your tokenizer, your router, your starting model --------------------------------------------

NOTES = "".join(
    f"note {i}: the {('red', 'green', 'blue')[i % 3]} robot moved {i % 7} boxes to the "
    f"{('hill', 'lake', 'barn', 'shed')[i % 4]} and wrote it down.\n"
    for i in range(120)
)
CUSTOM = "tests.custom_router_module"
SMALL = dict(steps=4, batch_size=2, seq_len=32, eval_every=4, checkpoint_every=4)


@pytest.fixture
def custom_router():
    """The strategy ``--import tests.custom_router_module`` registers, unregistered afterwards."""
    yield "tempered_softmax_top_k"
    if "tempered_softmax_top_k" in STRATEGIES:
        STRATEGIES.unregister("tempered_softmax_top_k")
    sys.modules.pop(CUSTOM, None)


def _user_inputs(tmp_path: Path, variants: dict) -> dict:
    (tmp_path / "notes.txt").write_text(NOTES)
    (tmp_path / "v.json").write_text(json.dumps(variants))
    return dict(
        data=(tmp_path / "notes.txt",),
        tokenizer=write_tokenizer_folder(tmp_path / "tokenizer"),
        import_modules=(CUSTOM,),
        variants_file=tmp_path / "v.json",
    )


def test_a_registered_router_runs_on_user_text_from_a_variants_file(tmp_path, capsys, custom_router):
    inputs = _user_inputs(tmp_path, {"tempered": {"moe.router.strategy": custom_router}})
    args = ablate.Args(out_dir=tmp_path / "out", **inputs, **SMALL)
    assert ablate.main(args) == 0, capsys.readouterr().err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(results["variants"]) == ["baseline", "tempered"]  # with a file: the baseline and the file's
    row = results["variants"]["tempered"]
    assert np.isfinite(row["eval_loss"]) and row["overrides"] == {"moe.router.strategy": custom_router}
    summary = json.loads((tmp_path / "out" / "tempered" / "summary.json").read_text())
    assert summary["config"]["moe"]["router"]["strategy"] == custom_router and summary["domains"] == ["notes"]
    assert results["settings"]["data"] == [str(tmp_path / "notes.txt")] and results["imports"] == [CUSTOM]
    assert f"| tempered | {row['eval_loss']:.3f} |" in (tmp_path / "out" / "results.md").read_text()

    words = shlex.split(row["command"])
    for flag, value in [("--import", CUSTOM), ("--data", inputs["data"][0]), ("--tokenizer", inputs["tokenizer"])]:
        assert words[words.index(flag) + 1] == str(value), flag
    parsed = tyro.cli(pretrain.Args, args=words[3:], config=(tyro.conf.OmitArgPrefixes,))
    assert parsed == ablate.pretrain_args(args, "tempered", ablate.variant_table(args))

    # Finished variants are skipped; a variant redefined in the file since is refused, not reported stale.
    summary_file = tmp_path / "out" / "tempered" / "summary.json"
    written = summary_file.stat().st_mtime_ns
    assert ablate.main(args) == 0 and summary_file.stat().st_mtime_ns == written
    (tmp_path / "v.json").write_text(json.dumps({"tempered": {"moe.router.top_k": 1}}))
    assert ablate.main(args) == 2
    assert "variant 'tempered' finished in" in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize(
    "variants, extra, message",
    [
        ({"bad": {"moe.router.topk": 1}}, {}, "variant 'bad': override 'moe.router.topk': RouterConfig has no field"),
        ({"bad": {"moe.router.top_k": "two"}}, {}, "variant 'bad': override moe.router.top_k='two': not a valid"),
        ([{"moe.router.top_k": 1}], {}, "expected a non-empty JSON object of variant name -> overrides"),
        ({"baseline": {}}, {}, "variant 'baseline' is built in"),
        ({"bad/name": {}}, {}, "variant name 'bad/name' is invalid"),
        ({"fine": {}}, {"variants": ("fine", "missing")}, "unknown variant(s) missing; known: baseline"),
        ({"fine": {}}, {"import_modules": ("tests.no_such_module",)}, "--import tests.no_such_module: ModuleNotFound"),
    ],
)
def test_bad_variants_files_and_imports_are_one_line_before_anything_trains(tmp_path, capsys, variants, extra, message):
    (tmp_path / "v.json").write_text(json.dumps(variants))
    args = ablate.Args(out_dir=tmp_path / "out", variants_file=tmp_path / "v.json", **{**SMALL, **extra})
    assert ablate.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("ablate: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()


def test_a_loaded_model_takes_routing_overrides_and_refuses_new_shapes(tmp_path, capsys):
    from eqmoe import Transformer
    from eqmoe.checkpoints import hf
    from eqmoe.checkpoints.model_checkpoint import save_model

    saved = Transformer(presets.get("qwen3-moe-micro"), key=jax.random.key(7))
    hf.save(saved, tmp_path / "hf")
    save_model(saved, tmp_path / "ckpt")
    routing = ("moe.router.strategy=top_k_softmax", "moe.router.top_k=1", "attention.qk_norm=after_rope")
    for start in ({"init_from_hf": tmp_path / "hf"}, {"init_from_checkpoint": tmp_path / "ckpt"}):
        options = pretrain.ModelOptions(override=routing, **start)
        config = pretrain.model_config(options)
        model = pretrain.starting_model(options, config, seed=0)
        assert model.config == config and config.moe.router.strategy == "top_k_softmax"
        np.testing.assert_array_equal(model.embed, saved.embed)  # the saved weights, not a fresh initialisation
        for override in (
            "moe.shared_experts=1",
            "moe.expert_dim=32",
            "norm.ffn_placement=post",
            "moe.router.bias_update_rate=0.001",
        ):
            with pytest.raises(UsageError, match=f"^{re.escape(override)} would change the parameters of the model"):
                pretrain.model_config(dataclasses.replace(options, override=(override,)))

    # In a grid the refusal names the variant, before anything trains; the row commands carry the start.
    capsys.readouterr()
    (tmp_path / "v.json").write_text(json.dumps({"shared": {"moe.shared_experts": 1}}))
    args = ablate.Args(out_dir=tmp_path / "out", init_from_hf=tmp_path / "hf", variants_file=tmp_path / "v.json")
    assert ablate.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "variant 'shared': moe.shared_experts=1 would change the parameters" in err
    words = shlex.split(ablate.command(ablate.pretrain_args(args, "baseline")))
    assert words[words.index("--init-from-hf") + 1] == str(tmp_path / "hf")


def test_the_input_flags_parse_as_documented():
    flags = ["--data", "a.txt", "b.jsonl", "--tokenizer", "tok", "--init-from-checkpoint", "ckpt"]
    flags += ["--variants-file", "v.json", "--import", "one", "--import", "pkg.two"]
    args = tyro.cli(ablate.Args, args=flags)
    assert args.data == (Path("a.txt"), Path("b.jsonl")) and args.import_modules == ("one", "pkg.two")
    assert (args.tokenizer, args.init_from_checkpoint, args.variants_file) == (
        Path("tok"),
        Path("ckpt"),
        Path("v.json"),
    )
    variant = ablate.pretrain_args(args, "baseline")
    words = shlex.split(ablate.command(variant))
    assert words.count("--import") == 2 and "--init-from-checkpoint" in words
    assert tyro.cli(pretrain.Args, args=words[3:], config=(tyro.conf.OmitArgPrefixes,)) == variant
