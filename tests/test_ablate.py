"""The ablation grid: runs over paired seeds and their statistics, matched FLOPs, reproducible runs, skipping
finished runs and resuming an interrupted one."""

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

import equinox as eqx
import jax
import numpy as np
import pytest
import tyro

from eqmoe import presets
from eqmoe.config_io import apply_overrides
from eqmoe.data import ByteTokenizer, PackedDataset
from eqmoe.data.corpus import pack_documents
from eqmoe.nn.router import STRATEGIES
from experiments import ablate, pretrain
from experiments._cli import UsageError
from tests.chat_fixtures import write_tokenizer_folder
from tests.conftest import kill_when

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(
    seeds=1,
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


# -m slow (about 30 s, two subprocess runs): a killed run resuming exactly is tests/test_reliability.py's (an ablation
# run is a pretrain run); finished runs read back untouched, test_two_variants_over_two_seeds_... and the registered
# router's test below
@pytest.mark.slow
def test_killed_variant_resumes_and_finished_variants_are_skipped(tmp_path):
    reference = ablate.run(ablate.Args(out_dir=tmp_path / "straight", variants=("baseline",), **TINY))

    out_dir = tmp_path / "killed"
    process = _ablate(out_dir)
    kill_when(process, (out_dir / "baseline" / "seed-0" / "checkpoints" / "8").is_dir)
    assert not (out_dir / "baseline" / "seed-0" / "summary.json").exists()

    resumed = _ablate(out_dir)
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert "resumed from step" in err
    results = json.loads((out_dir / "results.json").read_text())
    row, expected = results["variants"]["baseline"], reference["variants"]["baseline"]
    assert row["eval_loss"] == expected["eval_loss"] and row["load_cv"] == expected["load_cv"]
    assert row["overrides"] == {} and row["all_overrides"] == ablate.BASE_OVERRIDES
    assert "python -m experiments.pretrain" in (out_dir / "results.md").read_text()

    summary = out_dir / "baseline" / "seed-0" / "summary.json"
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
    trained = json.loads((out / name / "seed-0" / "summary.json").read_text())["config"]
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


def test_two_variants_over_two_seeds_give_intervals_paired_differences_and_compute(tmp_path):
    out = tmp_path / "grid"
    flags = {**TINY, "seeds": 2, "steps": 4, "eval_every": 2, "checkpoint_every": 4}
    args = ablate.Args(out_dir=out, variants=("baseline", "switch-top1"), **flags)
    results = ablate.run(args)
    rows = results["variants"]
    assert results["seeds"] == [0, 1] and list(rows) == ["baseline", "switch-top1"]
    for name, row in rows.items():
        assert row["seeds"] == [0, 1]
        for seed in (0, 1):
            summary = json.loads((out / name / f"seed-{seed}" / "summary.json").read_text())
            run = row["runs"][str(seed)]
            assert run["eval_loss"] == summary["eval_loss"] and summary["args"]["run"]["seed"] == seed
            assert set(run["domain_loss"]) == set(summary["domains"])
            words = shlex.split(run["command"])
            assert words[words.index("--out-dir") + 1] == str(out / name / f"seed-{seed}")
            assert ("--seed" in words) == (seed == 1)  # seed 0 is pretrain's default
        losses = [row["runs"][seed]["eval_loss"] for seed in ("0", "1")]
        assert losses[0] != losses[1]
        stats = row["stats"]["eval_loss"]
        assert stats["n"] == 2 and stats["low"] < row["eval_loss"] < stats["high"]
        assert row["eval_loss"] == pytest.approx(np.mean(losses))
        compute = row["compute"]
        assert compute["tokens_seen"] == 4 * args.batch_size * args.seq_len and compute["wall_seconds"] > 0
    base, variant = ([rows[name]["runs"][s]["eval_loss"] for s in ("0", "1")] for name in rows)
    compared = rows["switch-top1"]["vs_baseline"]
    assert compared["n"] == 2 and compared["mean"] == pytest.approx(np.mean(np.subtract(variant, base)))
    assert compared["p_value"] is not None and compared["min_detectable"] is not None
    assert rows["switch-top1"]["compute"]["active_parameters"] < rows["baseline"]["compute"]["active_parameters"]
    table = (out / "results.md").read_text()
    assert f"{compared['mean']:+.3f} [{compared['low']:+.3f}, {compared['high']:+.3f}]" in table
    assert f"| baseline | 2 | {rows['baseline']['eval_loss']:.3f} ± " in table and "Noise floor: " in table
    assert "## Held-out loss per domain" in table and "## Compute" in table
    for name in ("eval_loss.png", "load_balance.png"):
        assert (out / name).is_file()

    # Seed 0 of a folder of before seeds (NAME/summary.json ...) is read back as seed 0; nothing trains again.
    for name in rows:
        for path in (out / name / "seed-0").iterdir():
            path.rename(out / name / path.name)
        (out / name / "seed-0").rmdir()
    written = (out / "baseline" / "summary.json").stat().st_mtime_ns
    again = ablate.run(args)
    assert (out / "baseline" / "summary.json").stat().st_mtime_ns == written
    assert not (out / "baseline" / "seed-0").exists()
    for name, row in again["variants"].items():
        assert row["eval_loss"] == rows[name]["eval_loss"] and row["vs_baseline"] == rows[name]["vs_baseline"]
    words = shlex.split(again["variants"]["baseline"]["runs"]["0"]["command"])
    assert words[words.index("--out-dir") + 1] == str(out / "baseline")


def _made_up_run(seed: int, eval_loss: float, **figures) -> dict:
    return {
        "seed": seed,
        "command": f"python -m experiments.pretrain --seed {seed}",
        "eval_loss": eval_loss,
        "load_cv": 0.2,
        "max_min_ratio": float("inf"),
        "dropped_fraction": 0.0,
        "router_entropy": 0.9,
        "domain_nmi": None,
        "tokens_per_second": 100.0,
        "eval_curve": [[64, eval_loss + 1], [128, eval_loss]],
        **figures,
    }


def _made_up_results(runs: dict[str, dict[int, dict]]) -> dict:
    rows = {name: ablate.variant_row(ablate.VARIANTS[name], by_seed) for name, by_seed in runs.items()}
    seeds = sorted({seed for by_seed in runs.values() for seed in by_seed})
    return {
        "settings": ablate.settings(ablate.Args()),
        "seeds": seeds,
        "noise_floor": ablate.compare_rows(rows),
        "variants": rows,
    }


def test_one_seed_gives_means_without_intervals_or_marks_and_dashes_for_missing_figures():
    results = _made_up_results({"baseline": {0: _made_up_run(0, 1.5)}, "switch-top1": {0: _made_up_run(0, 1.6)}})
    table = ablate.results_table(results)
    assert "| baseline | 1 | 1.500 |  |  | 0.200 | – | 0.000 | 0.900 | inf | – | 100 |" in table  # no MaxVio
    assert "| switch-top1 | 1 | 1.600 | +0.100 (n=1) | – | 0.200 |" in table
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert not any(" *" in line or "±" in line for line in rows)
    assert "No comparison has two seeds" in table
    assert "Noise floor: unknown, the baseline ran with one seed." in table
    assert "  - seed 0: `python -m experiments.pretrain --seed 0`" in table
    row = results["variants"]["switch-top1"]
    assert row["vs_baseline"]["p_value"] is None and row["vs_baseline"]["holds"] is False
    json.dumps(results, allow_nan=True)  # every undefined figure is None, the rest numbers


def test_paired_differences_intervals_and_holm_marks_over_seeds():
    baseline = {0: 2.00, 1: 2.10, 2: 1.95, 3: 2.05}
    better = {seed: loss - 0.05 - 0.002 * seed for seed, loss in baseline.items()}  # the same gain on every seed
    noisy = {0: 2.10, 1: 2.00, 2: 1.97, 3: 2.09}
    results = _made_up_results(
        {
            "baseline": {s: _made_up_run(s, loss, max_vio=0.5) for s, loss in baseline.items()},
            "switch-top1": {s: _made_up_run(s, loss) for s, loss in better.items()},
            "router-z-loss": {s: _made_up_run(s, loss) for s, loss in noisy.items()},
        }
    )
    rows, table = results["variants"], ablate.results_table(results)
    gains = np.array([better[s] - baseline[s] for s in baseline])
    half = 3.182446 * gains.std(ddof=1) / 2  # t_{0.975,3} sd / sqrt(4)
    compared = rows["switch-top1"]["vs_baseline"]
    assert compared["mean"] == pytest.approx(gains.mean()) and compared["high"] == pytest.approx(gains.mean() + half)
    assert compared["holds"] and not rows["router-z-loss"]["vs_baseline"]["holds"]
    assert compared["min_detectable"] == pytest.approx((3.182446 + 0.978472) * gains.std(ddof=1) / 2, rel=1e-5)
    line = next(line for line in table.splitlines() if line.startswith("| switch-top1 |"))
    assert f"{compared['mean']:+.3f} [{compared['low']:+.3f}, {compared['high']:+.3f}] *" in line
    assert f"| {compared['min_detectable']:.3f} |" in line
    sd = np.std(list(baseline.values()), ddof=1)
    assert results["noise_floor"] == {"eval_loss_sd": pytest.approx(sd), "seeds": 4}
    assert f"sd {sd:.4f} over its 4 seeds" in table and "(t_{0.975,n-1} + t_{0.8,n-1}) sd_diff / √n" in table
    mean = np.mean(list(baseline.values()))
    spread = 3.182446 * sd / 2
    assert f"| baseline | 4 | {mean:.3f} ± {spread:.3f} |" in table and "| 0.500 ± 0.000 |" in table
    assert np.allclose(rows["baseline"]["eval_curve"], [[64, mean + 1], [128, mean]])


def test_seeds_are_consecutive_the_same_for_every_variant_and_not_part_of_the_settings(tmp_path):
    args = ablate.Args(out_dir=tmp_path, seed=5, seeds=3)
    assert ablate.seeds_of(args) == [5, 6, 7]
    for seed in ablate.seeds_of(args):
        runs = [ablate.pretrain_args(args, name, seed=seed).run for name in ("baseline", "switch-top1")]
        assert [run.seed for run in runs] == [seed, seed]
        assert [run.out_dir for run in runs] == [
            tmp_path / name / f"seed-{seed}" for name in ("baseline", "switch-top1")
        ]
    assert ablate.settings(args) == ablate.settings(dataclasses.replace(args, seeds=1))  # more seeds: same setting
    assert ablate.settings(ablate.Args()) == ablate.settings(dataclasses.replace(ablate.Args(), match="tokens"))
    assert ablate.settings(ablate.Args(match="active-flops"))["match"] == "active-flops"
    # A folder of before seeds holds the first seed's run; the other seeds go beside it.
    (tmp_path / "baseline").mkdir()
    (tmp_path / "baseline" / "summary.json").write_text("{}")
    assert ablate.run_folder(args, "baseline", 5) == tmp_path / "baseline"
    assert ablate.run_folder(args, "baseline", 6) == tmp_path / "baseline" / "seed-6"


def test_a_seed_changes_the_initial_parameters_and_the_data_order_together():
    args = ablate.Args(**TINY)
    parameters = {}
    for seed in (0, 1):
        for name in ("baseline", "switch-top1"):
            variant = ablate.pretrain_args(args, name, seed=seed)
            model = pretrain.starting_model(variant.model, pretrain.model_config(variant.model), variant.run.seed)
            parameters[name, seed] = [np.asarray(leaf) for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
    # The variants of one seed start from the same parameters (a router change reshapes none): a paired start.
    for seed in (0, 1):
        for a, b in zip(parameters["baseline", seed], parameters["switch-top1", seed], strict=True):
            np.testing.assert_array_equal(a, b)
    assert not any(
        np.array_equal(a, b)
        for a, b in zip(parameters["baseline", 0], parameters["baseline", 1], strict=True)
        if a.std()
    )

    # The training loop draws batch n as dataset.batch_at(n, batch_size, run.seed): the order follows the seed too.
    variant = ablate.pretrain_args(args, "baseline", seed=0)
    train, _, _ = pretrain._documents(variant.data, variant.run.seed)
    dataset = PackedDataset(pack_documents(train, ByteTokenizer(), args.seq_len).packed.rows)
    orders = {
        seed: np.concatenate([dataset.indices_at(step, args.batch_size, seed) for step in range(8)]) for seed in (0, 1)
    }
    assert not np.array_equal(orders[0], orders[1])
    epochs = [dataset.indices_at(0, len(dataset), seed) for seed in (0, 1)]
    np.testing.assert_array_equal(np.sort(epochs[0]), np.sort(epochs[1]))  # the same rows, in another order


def test_match_active_flops_picks_widths_within_two_percent_of_the_baseline(tmp_path, capsys):
    from eqmoe.flops import model_flops_per_token

    sweep = {
        "experts-x2-top-k-x2": {"moe.router.num_experts": 16, "moe.router.top_k": 4},
        "top-k-x2": {"moe.router.top_k": 4},
        "top-1": {"moe.router.top_k": 1},
        "own-width": {"moe.router.top_k": 4, "moe.expert_dim": 48},
    }
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    args = ablate.Args(out_dir=tmp_path / "out", variants_file=tmp_path / "sweep.json", match="active-flops", **TINY)
    table = ablate.variant_table(args)
    names = ablate.chosen_variants(args, table)
    resolved, origin = ablate._resolve_widths(args, table, names)
    configs = ablate.check_variants(args, resolved, names)
    target = model_flops_per_token(configs["baseline"], args.seq_len)
    gap = {name: model_flops_per_token(configs[name], args.seq_len) / target - 1 for name in names}
    assert {name: resolved[name].get("moe.expert_dim") for name in names} == {
        "baseline": None,
        "experts-x2-top-k-x2": 32,
        "top-k-x2": 32,
        "top-1": 128,
        "own-width": 48,
    }
    assert origin["top-1"] == "match" and origin["own-width"] == "variant" and origin["baseline"] == "base"
    for name in ("experts-x2-top-k-x2", "top-k-x2", "top-1"):
        assert abs(gap[name]) <= 0.02, (name, gap[name])
        # No other multiple of 8 comes closer.
        widths = range(8, 257, 8)
        flops = [
            model_flops_per_token(apply_overrides(configs[name], {"moe.expert_dim": w}), args.seq_len) for w in widths
        ]
        assert widths[int(np.argmin(np.abs(np.asarray(flops) - target)))] == configs[name].moe.expert_dim
    assert gap["own-width"] > 0.2  # left alone, its gap reported

    ablate._report_widths(names, configs, origin, args.seq_len)
    printed = capsys.readouterr().err
    assert "  top-1: 128 (match), " in printed and "  own-width: 48 (variant), +" in printed
    compute = ablate.compute_of(configs["top-1"], configs["baseline"], args.seq_len, origin["top-1"])
    assert compute["expert_dim"] == 128 and compute["flop_gap"] == pytest.approx(gap["top-1"])
    assert compute["active_parameters"] < compute["total_parameters"]


def test_dry_run_prints_the_shipped_granularity_sweep_within_two_percent_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--match", "active-flops", "--variants-file", str(ROOT / "experiments/granularity.json"), "--dry-run"]
    args = tyro.cli(ablate.Args, args=[*argv, "--override", "moe.expert_dim=512", "--out-dir", str(out)])
    assert ablate.main(args) == 0
    printed = capsys.readouterr().err
    widths = dict(re.findall(r"  (granularity-\dx): (\d+) \(match\), [+-]", printed))
    gaps = [float(gap) for gap in re.findall(r"\(match\), ([+-][\d.]+)%", printed)]
    assert widths == {"granularity-2x": "256", "granularity-4x": "128", "granularity-8x": "64"}
    assert len(gaps) == 3 and all(abs(gap) <= 2 for gap in gaps) and "beyond" not in printed
    assert "granularity-8x" in printed and "seeds 0 to train, 1 to train, 2 to train" in printed
    assert not out.exists()


# --- your data, your tokenizer, your router, your starting model --------------------------------------------

NOTES = "".join(
    f"note {i}: the {('red', 'green', 'blue')[i % 3]} robot moved {i % 7} boxes to the "
    f"{('hill', 'lake', 'barn', 'shed')[i % 4]} and wrote it down.\n"
    for i in range(120)
)
CUSTOM = "tests.custom_router_module"
SMALL = dict(seeds=1, steps=4, batch_size=2, seq_len=32, eval_every=4, checkpoint_every=4)


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
    summary = json.loads((tmp_path / "out" / "tempered" / "seed-0" / "summary.json").read_text())
    assert summary["config"]["moe"]["router"]["strategy"] == custom_router and summary["domains"] == ["notes"]
    assert results["settings"]["data"] == [str(tmp_path / "notes.txt")] and results["imports"] == [CUSTOM]
    assert f"| tempered | 1 | {row['eval_loss']:.3f} |" in (tmp_path / "out" / "results.md").read_text()

    words = shlex.split(row["command"])
    for flag, value in [("--import", CUSTOM), ("--data", inputs["data"][0]), ("--tokenizer", inputs["tokenizer"])]:
        assert words[words.index(flag) + 1] == str(value), flag
    parsed = tyro.cli(pretrain.Args, args=words[3:], config=(tyro.conf.OmitArgPrefixes,))
    assert parsed == ablate.pretrain_args(args, "tempered", ablate.variant_table(args))

    # Finished variants are skipped; a variant redefined in the file since is refused, not reported stale.
    summary_file = tmp_path / "out" / "tempered" / "seed-0" / "summary.json"
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


def test_runs_finished_under_a_base_override_are_taken_again(tmp_path):
    """A grid run with ``--override`` (every variant's base) is read back when seeds are added, not refused."""
    args = ablate.Args(variants=("baseline",), out_dir=tmp_path, seeds=1, override=("moe.expert_dim=128",))
    summary = {"overrides": {"moe.expert_dim": 128, **ablate.BASE_OVERRIDES}}
    folder = ablate.run_folder(args, "baseline", 0)
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(summary))
    ablate.check_variants(args, ablate.VARIANTS, ["baseline"])  # the same setting: no error
    (folder / "summary.json").write_text(json.dumps({"overrides": ablate.BASE_OVERRIDES}))
    with pytest.raises(ablate.UsageError, match="finished in .* with other overrides"):
        ablate.check_variants(args, ablate.VARIANTS, ["baseline"])


def test_eval_task_scores_are_passed_to_each_run_and_get_intervals_over_seeds(tmp_path):
    args = ablate.Args(out_dir=tmp_path, eval_tasks=("arc_easy",), limit=50.0, include_path=tmp_path)
    variant = ablate.pretrain_args(args, "switch-top1", seed=1)
    assert (
        variant.eval.eval_tasks == ("arc_easy",) and variant.eval.limit == 50 and variant.eval.include_path == tmp_path
    )
    assert "--eval-tasks arc_easy" in ablate.command(variant)

    def run(seed, acc):
        return _made_up_run(seed, 1.5, lm_eval={"arc_easy": {"acc": acc, "acc_stderr": 0.05}})

    results = _made_up_results({"baseline": {0: run(0, 0.50), 1: run(1, 0.54)}, "switch-top1": {0: run(0, 0.40)}})
    baseline = results["variants"]["baseline"]
    assert baseline["lm_eval"] == {"arc_easy/acc": pytest.approx(0.52)}  # the per-run stderr is not averaged
    assert baseline["stats"]["lm_eval"]["arc_easy/acc"]["n"] == 2
    half = (
        baseline["stats"]["lm_eval"]["arc_easy/acc"]["high"] - baseline["stats"]["lm_eval"]["arc_easy/acc"]["low"]
    ) / 2
    table = ablate.results_table(results)
    assert "## lm-eval scores of the final models" in table
    assert f"| baseline | 0.5200 ± {half:.4f} |" in table and "| switch-top1 | 0.4000 |" in table
