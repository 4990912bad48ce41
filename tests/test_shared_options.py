"""One set of flags: every experiment's parser is walked, and an option of a shared group (experiments/options.py,
the run's output and tracker options) has the same name, type and help wherever it appears; ``--override`` works
wherever a model is built."""

import dataclasses
import importlib
import re
import warnings
from pathlib import Path

import pytest
import tyro

from eqmoe.train.loop import OutputOptions
from eqmoe.train.tracking import TrackerOptions
from experiments import options

COMMANDS = sorted(
    path.stem
    for path in (Path(__file__).parents[1] / "experiments").glob("*.py")
    if not path.stem.startswith("_") and path.stem != "options"
)
GROUPS = [
    value
    for value in vars(options).values()
    if isinstance(value, type) and dataclasses.is_dataclass(value) and value.__module__ == options.__name__
] + [OutputOptions, TrackerOptions]
SHARED = {"--" + f.name.replace("_", "-") for group in GROUPS for f in dataclasses.fields(group)} | {"--import"}
# bench_model's shape flags override each of its benchmark rows' own shapes (None: the row's); inspect_data's --limit
# (conversations to print) predates lm-eval's --limit (documents per task), which evaluate keeps under lm-eval's name
OVERRIDES_OF_ITS_ROWS = {("bench_model", "--batch-size"), ("bench_model", "--seq-len"), ("inspect_data", "--limit")}


def _options(command: str) -> dict[str, tuple[str, str | None]]:
    """``{flag: (help without its default, metavar)}`` of the command's parser."""
    module = importlib.import_module(f"experiments.{command}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        parser = tyro.extras.get_parser(module.Args, config=(tyro.conf.OmitArgPrefixes,))
    found = {}
    for action in parser._actions:
        for flag in action.option_strings:
            text = " ".join((action.help or "").split())
            found[flag] = (re.sub(r"\s*\((default|required)[^()]*(\([^()]*\)[^()]*)*\)$", "", text), action.metavar)
    return found


@pytest.fixture(scope="module")
def parsers() -> dict[str, dict[str, tuple[str, str | None]]]:
    return {command: _options(command) for command in COMMANDS}


def test_every_command_has_a_parser_and_the_old_names_are_gone(parsers):
    assert len(parsers) >= 17
    for command, flags in parsers.items():
        assert not {"--batch", "--seq", "--out-json"} & set(flags), command
        if command not in ("convert", "upcycle"):  # their --out is the checkpoint folder they write
            assert "--out" not in flags, command


def test_a_shared_option_has_one_name_type_and_help_everywhere(parsers):
    seen: dict[str, dict[tuple, list[str]]] = {}
    for command, flags in parsers.items():
        for flag, described in flags.items():
            if flag in SHARED and (command, flag) not in OVERRIDES_OF_ITS_ROWS:
                seen.setdefault(flag, {}).setdefault(described, []).append(command)
    differing = {flag: by for flag, by in seen.items() if len(by) > 1}
    assert not differing, differing
    for flag in ("--tokenizer", "--batch-size", "--seq-len", "--dtype", "--mesh", "--out-dir", "--override", "--json"):
        assert sum(len(commands) for commands in seen[flag].values()) >= 4, flag  # shared indeed


def test_override_works_wherever_a_model_is_built(capsys):
    from experiments import ablate, plan, pretrain, sft

    top1 = ("moe.router.top_k=1",)
    sft_args = sft.ModelOptions(override=top1)
    assert sft.execution_config(sft_args.preset_config(), sft_args).moe.router.top_k == 1
    assert pretrain.model_config(pretrain.ModelOptions(override=top1)).moe.router.top_k == 1
    variant = ablate.pretrain_args(ablate.Args(override=top1), "switch-top1")
    assert variant.model.override[0] == "moe.router.top_k=1"
    assert plan.Args(override=top1).preset_config().moe.router.top_k == 1
    parsed = tyro.cli(sft.Args, args=["--override", "moe.router.top_k=1"], config=(tyro.conf.OmitArgPrefixes,))
    assert parsed.model.override == top1
    capsys.readouterr()
    assert plan.main(plan.Args(override=("moe.router.top_kk=1",), compile=False)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "top_kk" in err[0], err
