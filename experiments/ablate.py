"""Router and norm ablations: every variant trained with the same seed, data order and token budget.

    python -m experiments.ablate                                  # the default grid, ~9 min on 2 CPU cores
    python -m experiments.ablate --variants baseline switch-top1  # a subset
    python -m experiments.ablate --steps 1000 --out-dir runs/ablate-long
    python -m experiments.ablate --data notes.txt --tokenizer DIR --import my_router --variants-file v.json

A variant is a named set of config overrides on the base (``--preset``, or the model of ``--init-from-hf`` /
``--init-from-checkpoint``, plus :data:`BASE_OVERRIDES`); add one with one line in :data:`VARIANTS`, or in a
``--variants-file``: a JSON object ``{"name": {"field.path": value}}`` (with one and no ``--variants``,
``baseline`` and the file's variants run). ``--import MODULE`` is imported before any variant is checked, so a
router strategy (or any part) it registers can be named there. ``--data`` and ``--tokenizer`` are pretrain's.
Every variant is checked before any trains: a bad field or value names its variant. Each variant is an
``experiments.pretrain`` run in ``--out-dir/NAME``: a variant with a ``summary.json`` is skipped (refused if
it finished with other overrides), and one that was interrupted resumes
from its last checkpoint. Outputs: ``results.md`` (the table and, per row, the ``pretrain`` command
that reproduces it), ``results.json`` (every figure, per layer too, and each variant's overrides),
``eval_loss.png`` (eval loss against tokens seen) and ``load_balance.png`` (load CV per variant and layer).
"""

import dataclasses
import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

from eqmoe.config_io import format_override, parse_override
from eqmoe.train.logging import new_figure, save_figure, write_json_atomic
from eqmoe.train.loop import OutputOptions
from eqmoe.train.tracking import TrackerOptions
from experiments import pretrain
from experiments._cli import UsageError, guarded
from experiments.options import MeshOptions, ShapeOptions, StartOptions, TokenizerOption, import_modules

# Every variant starts from these; a stronger load-balance loss than HF's 0.001 default so that turning
# it off is a visible change within a short run.
BASE_OVERRIDES: dict[str, object] = {"loss.load_balance_weight": 0.01}

_GROUPS = {"moe.router.num_groups": 8}

VARIANTS: dict[str, dict[str, object]] = {
    "baseline": {},  # HF Qwen3: softmax, top-2, renormalised, dropless
    "softmax-topk-no-renorm": {"moe.router.renormalize": False},
    "maxtext-topk-softmax-top1": {"moe.router.strategy": "top_k_softmax", "moe.router.top_k": 1},
    "switch-top1": {"moe.router.top_k": 1, "moe.router.renormalize": False},
    # AXLearn's capacity is per group: groups of 256 tokens here (and cheaper [G, S, E, C] dispatch).
    "top2-gating-capacity-1": {"moe.router.strategy": "top2_gating", "moe.router.capacity_factor": 1.0, **_GROUPS},
    "top2-gating-capacity-2": {"moe.router.strategy": "top2_gating", "moe.router.capacity_factor": 2.0, **_GROUPS},
    "top2-gating-dropless": {"moe.router.strategy": "top2_gating"},
    "sigmoid-bias-balance": {
        "moe.router.strategy": "sigmoid_top_k",
        "moe.router.bias_update_rate": 0.001,
        "loss.load_balance_weight": 0.0,
    },
    "no-load-balance-loss": {"loss.load_balance_weight": 0.0},
    "router-z-loss": {"loss.router_z_loss_weight": 0.001},
    "ffn-norm-post": {"norm.ffn_placement": "post"},
    "ffn-norm-hybrid": {"norm.ffn_placement": "hybrid"},
    "qk-norm-off": {"attention.qk_norm": "none"},
    "qk-norm-after-rope": {"attention.qk_norm": "after_rope"},
    # What the other families bring, on the same base (their published choices in the comments):
    "qk-norm-whole-projection": {"attention.qk_norm_scope": "projection"},  # OLMoE
    "attention-qkv-bias": {"attention.bias": "qkv"},  # Qwen2-MoE, GLM-4.5
    "partial-rope-half": {"attention.rotary_dim": 8},  # GLM-4.5: half of each 16-wide head rotates
    "shared-expert": {"moe.shared_experts": 1},  # GLM-4.5, DeepSeek: one always-on expert of the routed width
    "shared-expert-gated": {"moe.shared_experts": 1, "moe.shared_expert_gate": True},  # Qwen2-MoE
    "group-limited-sigmoid": {  # GLM-4.5 / DeepSeek-V3 routing: 4 groups of 2 experts, the best 2 groups eligible
        "moe.router.strategy": "sigmoid_top_k",
        "moe.router.bias_update_rate": 0.001,
        "moe.router.expert_groups": 4,
        "moe.router.expert_groups_kept": 2,
        "loss.load_balance_weight": 0.0,
    },
}


@dataclass(frozen=True)
class Args(StartOptions, ShapeOptions, TokenizerOption, MeshOptions, TrackerOptions, OutputOptions):
    """Every variant starts from the same model (``--preset`` or ``--init-from-*``, with ``--override``) and trains
    on the same data; the variants differ only in their own overrides."""

    wandb_project: str = "eqmoe-ablate"
    variants: tuple[str, ...] = ()
    """Variants to run, by name (default: all of VARIANTS; with --variants-file, baseline and the file's)."""
    variants_file: Path | None = None
    """More variants: a JSON object {"name": {"field.path": value}}, e.g. {"top1": {"moe.router.top_k": 1}}."""
    out_dir: Path = Path("runs/ablate")
    steps: int = 300
    """Optimizer steps per variant."""
    learning_rate: float = 3e-3
    """Peak learning rate (50 warmup steps, cosine to a tenth at the last step)."""
    eval_every: int = 50
    """Evaluate every N steps (the eval-loss curve's resolution)."""
    checkpoint_every: int = 50
    """Checkpoint every N steps: at most this many steps are redone after an interruption."""
    seed: int = 0
    """Seed for parameters, data and data order, the same for every variant."""
    data: tuple[Path, ...] = ()
    """Text files (one document each) or JSONL files of {"text", "domain"} (default: the built-in corpus)."""
    chars_per_domain: int = 400_000
    """Built-in corpus: training characters of each domain."""
    eval_chars_per_domain: int = 10_000
    """Built-in corpus: held-out characters of each domain."""


# Inputs of a run that may be left unset; unset, they are left out of the settings, so an output folder written
# before they existed keeps its settings.
_OPTIONAL_INPUTS = {
    "data": (),
    "tokenizer": None,
    "init_from_hf": None,
    "init_from_checkpoint": None,
    "override": (),
    "dtype": "float32",
    "remat": "none",
}


def settings(args: Args) -> dict:
    """What every variant shares; an output folder holds results of one setting only."""
    fields = dataclasses.asdict(args)
    views = {f.name for f in dataclasses.fields(MeshOptions) + dataclasses.fields(TrackerOptions)}
    views |= {"variants", "out_dir", "variants_file", "import_modules"}
    kept = {
        name: value
        for name, value in fields.items()
        if name not in views and not (name in _OPTIONAL_INPUTS and value == _OPTIONAL_INPUTS[name])
    }
    return json.loads(json.dumps(kept, default=str))  # as ablation.json reads back: paths as text, lists


_VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # it names the variant's folder


def read_variants_file(path: Path) -> dict[str, dict[str, object]]:
    """``--variants-file``: variant name -> {field path: value}; its shape is checked here, its fields and values
    by :func:`check_variants`."""
    where = f"--variants-file {path}"
    try:
        table = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{where}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UsageError(f"{where}: not valid JSON ({error})") from None
    example = '{"top1": {"moe.router.top_k": 1}}'
    if not isinstance(table, dict) or not table:
        raise UsageError(f"{where}: expected a non-empty JSON object of variant name -> overrides, e.g. {example}")
    for name, overrides in table.items():
        if not _VARIANT_NAME.fullmatch(name):
            raise UsageError(f"{where}: variant name {name!r} is invalid; allowed: letters, digits, '.', '_', '-'")
        if name in VARIANTS:
            raise UsageError(f"{where}: variant {name!r} is built in (experiments/ablate.py); give yours another name")
        if not isinstance(overrides, dict):
            raise UsageError(
                f"{where}: variant {name!r}: expected an object of field path -> value, got {json.dumps(overrides)}"
            )
    return table


def variant_table(args: Args) -> dict[str, dict[str, object]]:
    """Every variant by name: :data:`VARIANTS` and those of ``--variants-file``."""
    return {**VARIANTS, **(read_variants_file(args.variants_file) if args.variants_file is not None else {})}


def chosen_variants(args: Args, table: dict[str, dict[str, object]]) -> list[str]:
    """``--variants``; by default every built-in variant, or with a variants file ``baseline`` and the file's."""
    unknown = [name for name in args.variants if name not in table]
    if unknown:
        raise UsageError(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(table)}")
    if args.variants:
        return list(args.variants)
    if args.variants_file is None:
        return list(VARIANTS)
    return ["baseline", *(name for name in table if name not in VARIANTS)]


def pretrain_args(args: Args, name: str, table: dict[str, dict[str, object]] | None = None) -> pretrain.Args:
    """The ``experiments.pretrain`` arguments of variant ``name`` (of ``table``, default :data:`VARIANTS`)."""
    overrides = {**BASE_OVERRIDES, **(VARIANTS if table is None else table)[name]}
    defaults = pretrain.Args()
    return pretrain.Args(
        model=dataclasses.replace(
            defaults.model,
            preset=args.preset,
            override=args.override + tuple(format_override(k, v) for k, v in overrides.items()),
            dtype=args.dtype,
            remat=args.remat,
            init_from_hf=args.init_from_hf,
            init_from_checkpoint=args.init_from_checkpoint,
            import_modules=args.import_modules,
        ),
        data=dataclasses.replace(
            defaults.data,
            data=args.data,
            tokenizer=args.tokenizer,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            chars_per_domain=args.chars_per_domain,
            eval_chars_per_domain=args.eval_chars_per_domain,
        ),
        optim=dataclasses.replace(
            defaults.optim,
            learning_rate=args.learning_rate,
            warmup_steps=min(50, args.steps // 4),
            decay_steps=args.steps,
        ),
        run=dataclasses.replace(
            defaults.run,
            steps=args.steps,
            out_dir=args.out_dir / name,
            checkpoint_every=args.checkpoint_every,
            eval_every=args.eval_every,
            log_every=min(50, args.steps),
            seed=args.seed,
            tracker=args.tracker,
            wandb_project=args.wandb_project,
        ),
        parallel=MeshOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(MeshOptions)}),
    )


# Options given once per item under a name of their own (experiments.options.ImportModules).
_REPEATED_FLAGS = {"import_modules": "--import"}


def command(args: pretrain.Args) -> str:
    """The ``python -m experiments.pretrain`` command line for ``args`` (flags that differ from the defaults)."""
    words = ["python", "-m", "experiments.pretrain"]
    defaults = pretrain.Args()
    for group in dataclasses.fields(args):
        value, default = getattr(args, group.name), getattr(defaults, group.name)
        for option in dataclasses.fields(value):
            chosen = getattr(value, option.name)
            if chosen == getattr(default, option.name):
                continue
            flag = "--" + option.name.replace("_", "-")
            if option.name in _REPEATED_FLAGS:
                words += [word for item in chosen for word in (_REPEATED_FLAGS[option.name], str(item))]
            elif isinstance(chosen, bool):
                words.append(flag if chosen else "--no-" + flag[2:])
            elif isinstance(chosen, tuple):
                words += [flag, *map(str, chosen)]
            else:
                words += [flag, str(chosen)]
    return shlex.join(words)


def _variant_record(args: pretrain.Args, summary: dict, overrides: dict[str, object]) -> dict:
    records = [json.loads(line) for line in (args.run.out_dir / "metrics.jsonl").read_text().splitlines() if line]
    tokens_per_step = args.data.batch_size * args.data.seq_len
    curve = [[r["step"] * tokens_per_step, r["eval_loss"]] for r in records if "eval_loss" in r]
    return {
        "overrides": overrides,
        "all_overrides": {**BASE_OVERRIDES, **overrides},
        "command": command(args),
        "eval_loss": summary["eval_loss"],
        "final_train_loss": summary["final_loss"],
        "load_cv": summary.get("eval_load_cv"),
        "max_min_ratio": summary.get("eval_max_min_ratio"),
        "dropped_fraction": summary.get("eval_dropped_fraction"),
        "router_entropy": summary.get("eval_router_entropy"),
        "domain_nmi": summary.get("eval_domain_nmi"),
        "tokens_per_second": summary["tokens_per_second"],
        "eval_curve": curve,
        "layers": summary.get("layers"),
    }


def _cell(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    return "inf" if value == float("inf") else f"{value:.{digits}f}"


def results_table(results: dict) -> str:
    """``results.md``: one row per variant, then the command reproducing each."""
    base = results["variants"].get("baseline", {}).get("eval_loss")
    run = results["settings"]
    start = run.get("init_from_hf") or run.get("init_from_checkpoint")
    quoted = lambda items: ", ".join(f"`{item}`" for item in items)  # noqa: E731
    inputs = [
        f"{label}: {quoted(items)}."
        for label, items in (
            ("Data", run.get("data", [])),
            ("Tokenizer", [run["tokenizer"]] if "tokenizer" in run else []),
            ("Imported modules", results.get("imports", [])),
        )
        if items
    ]
    model = f"from `{start}`" if start else f"on {run['preset']}"
    lines = [
        f"# Ablation {model}: {run['steps']} steps x {run['batch_size']} x {run['seq_len']} tokens, seed {run['seed']}",
        "",
        f"Base overrides: `{json.dumps(BASE_OVERRIDES)}`. Routing figures are on the held-out set at the end, averaged "
        "over MoE layers; NMI is the normalised mutual information of expert choice and data domain.",
        *(["", " ".join(inputs)] if inputs else []),
        "",
        "| variant | eval loss | vs baseline | load CV | max/min load | dropped | router entropy | domain NMI "
        "| tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results["variants"].items():
        delta = "" if base is None or name == "baseline" else f"{row['eval_loss'] - base:+.3f}"
        lines.append(
            f"| {name} | {row['eval_loss']:.3f} | {delta} | {_cell(row['load_cv'])} | {_cell(row['max_min_ratio'], 1)} "
            f"| {_cell(row['dropped_fraction'])} | {_cell(row['router_entropy'])} | {_cell(row['domain_nmi'])} "
            f"| {row['tokens_per_second'] or 0:,.0f} |"
        )
    lines += ["", "## Reproduce a row", ""]
    for name, row in results["variants"].items():
        lines += [f"- {name} (`{json.dumps(row['overrides'])}`):", f"  `{row['command']}`"]
    return "\n".join(lines) + "\n"


def plot_results(results: dict, out_dir: Path) -> None:
    """``eval_loss.png`` and ``load_balance.png``."""
    from matplotlib import colormaps

    variants = results["variants"]
    figure = new_figure(figsize=(9, 5.5))
    axis = figure.subplots()
    colors = colormaps["tab20"].colors
    for number, (name, row) in enumerate(variants.items()):
        curve = np.asarray(row["eval_curve"])
        style = "o-" if name == "baseline" else (".-" if number % 2 else ".--")
        axis.plot(curve[:, 0], curve[:, 1], style, label=name, markersize=4, color=colors[number % len(colors)])
    axis.set_xlabel("tokens seen")
    axis.set_ylabel("eval loss (nats/token)")
    axis.set_yscale("log")
    axis.legend(fontsize=7, ncol=2)
    axis.set_title("held-out loss per variant")
    save_figure(figure, out_dir / "eval_loss.png")

    names = [name for name, row in variants.items() if row.get("layers")]
    if names:
        table = np.asarray([variants[name]["layers"]["load_cv"] for name in names])
        figure = new_figure(figsize=(2 + 1.2 * table.shape[1], 0.4 * len(names) + 1.5))
        axis = figure.subplots()
        image = axis.imshow(table, cmap="magma_r", aspect="auto")
        axis.set_yticks(range(len(names)), names, fontsize=8)
        axis.set_xticks(range(table.shape[1]), [f"MoE {i}" for i in range(table.shape[1])])
        for (i, j), value in np.ndenumerate(table):
            shade = "white" if value > 0.6 * table.max() else "black"
            axis.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7, color=shade)
        figure.colorbar(image, label="load CV (0 = uniform)")
        axis.set_title("expert load imbalance per variant and layer")
        figure.tight_layout()
        save_figure(figure, out_dir / "load_balance.png")


def _as_recorded(overrides: dict[str, object]) -> dict[str, object]:
    """``overrides`` as a pretrain summary records them (through their ``FIELD.PATH=VALUE`` text)."""
    return dict(parse_override(format_override(path, value)) for path, value in overrides.items())


def check_variants(args: Args, table: dict[str, dict[str, object]], names: list[str]) -> None:
    """Build the config of every variant to run and of every variant in the file, before any trains: a bad field
    or value, or one that would reshape a loaded model, is a ``UsageError`` naming the variant. A variant that
    finished before must have finished with its overrides of now (else its row would report another run)."""
    start = pretrain.start_config(pretrain_args(args, "baseline", table).model)
    for name in dict.fromkeys([*names, *(name for name in table if name not in VARIANTS)]):
        variant = pretrain_args(args, name, table)
        try:
            pretrain.model_config(variant.model, start)
        except (ValueError, UsageError) as error:
            where = "" if name in VARIANTS else f"--variants-file {args.variants_file}: "
            raise UsageError(f"{where}variant {name!r}: {error}") from None
        summary_path = variant.run.out_dir / "summary.json"
        if name in names and summary_path.is_file():
            recorded = json.loads(summary_path.read_text()).get("overrides")
            if recorded != _as_recorded({**BASE_OVERRIDES, **table[name]}):
                raise UsageError(
                    f"variant {name!r} finished in {variant.run.out_dir} with other overrides {json.dumps(recorded)} "
                    f"(now {json.dumps(table[name])} on the base); rename it, or use another --out-dir"
                )


def run(args: Args) -> dict:
    import_modules(args.import_modules)  # before any config is checked: what it registers is nameable
    table = variant_table(args)
    names = chosen_variants(args, table)
    check_variants(args, table, names)
    settings_path = args.out_dir / "ablation.json"
    if settings_path.is_file() and json.loads(settings_path.read_text()) != settings(args):
        raise UsageError(
            f"{args.out_dir} holds an ablation with other settings ({settings_path}); use another --out-dir"
        )
    write_json_atomic(settings_path, settings(args))
    results_path = args.out_dir / "results.json"
    previous = json.loads(results_path.read_text())["variants"] if results_path.is_file() else {}
    variants = {}
    for number, name in enumerate(names, start=1):
        variant_args = pretrain_args(args, name, table)
        summary_path = variant_args.run.out_dir / "summary.json"
        if summary_path.is_file():
            print(f"[{number}/{len(names)}] {name}: finished before, skipped", file=sys.stderr)
            summary = json.loads(summary_path.read_text())
        else:
            print(f"[{number}/{len(names)}] {name}: {json.dumps(table[name])}", file=sys.stderr)
            interrupted = (variant_args.run.out_dir / "checkpoints").is_dir()
            summary = pretrain.run(
                dataclasses.replace(variant_args, run=dataclasses.replace(variant_args.run, resume=interrupted))
            )
        variants[name] = _variant_record(variant_args, summary, table[name])
    results = {
        "settings": settings(args),
        "base_overrides": BASE_OVERRIDES,
        "imports": list(args.import_modules),
        "variants": {**previous, **variants},
    }
    write_json_atomic(results_path, results)
    (args.out_dir / ".results.md.tmp").write_text(results_table(results))
    (args.out_dir / ".results.md.tmp").replace(args.out_dir / "results.md")
    plot_results(results, args.out_dir)
    return results


def main(args: Args) -> int:
    results = guarded("ablate", run, args)
    if results is None:
        return 2
    print(results_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
