"""Router and norm ablations: every variant trained on the same seeds, data orders and token budget.

    python -m experiments.ablate                                  # the default grid, 3 seeds, ~1.5 h on 2 CPU cores
    python -m experiments.ablate --variants baseline switch-top1  # a subset
    python -m experiments.ablate --seeds 5 --steps 1000 --out-dir runs/ablate-long
    python -m experiments.ablate --match active-flops --variants-file experiments/granularity.json --dry-run
    python -m experiments.ablate --data notes.txt --tokenizer DIR --import my_router --variants-file v.json

A variant is a named set of config overrides on the base (``--preset``, or the model of ``--init-from-hf`` /
``--init-from-checkpoint``, plus :data:`BASE_OVERRIDES`); add one with one line in :data:`VARIANTS`, or in a
``--variants-file``: a JSON object ``{"name": {"field.path": value}}`` (with one and no ``--variants``,
``baseline`` and the file's variants run). ``--import MODULE`` is imported before any variant is checked, so a
router strategy (or any part) it registers can be named there. ``--data`` and ``--tokenizer`` are pretrain's.
Every variant is checked before any trains: a bad field or value names its variant.

Every variant runs once per seed ``--seed, --seed + 1, ...`` (``--seeds`` of them), the same seeds for every
variant: a seed sets the initial parameters and the data order together (and the text of the built-in corpus), so
a variant and the baseline of one seed differ only in the variant's overrides and their difference is paired.
Each run is an ``experiments.pretrain`` run in ``--out-dir/NAME/seed-S`` (a folder written before seeds existed,
``--out-dir/NAME``, is read as seed ``--seed``): a run with a ``summary.json`` is skipped (refused if it finished
with other overrides), and one that was interrupted resumes from its last checkpoint. More seeds may be added to a
folder later; other settings may not.

``--match tokens`` (the default) trains every variant on the same steps x batch x seq tokens; ``--match
active-flops`` also sets each variant's ``moe.expert_dim`` (a multiple of 8) to bring its model FLOPs per token
closest to the baseline's, within 2% where the step of 8 allows (a variant that sets ``moe.expert_dim`` itself keeps
it); the widths and the FLOP gaps left are printed and stored.

Outputs: ``results.md`` (per variant the mean and 95% t-interval over seeds of every figure, the paired difference
to the baseline with its interval, whether it holds after a Holm correction over the grid, the smallest difference
the comparison could detect, the baseline's seed-to-seed spread, the compute of each variant, and per run the
``pretrain`` command that reproduces it), ``results.json`` (every figure, per seed and per layer too, and each
variant's overrides), ``eval_loss.png`` (eval loss against tokens seen, a band over seeds) and ``load_balance.png``
(load CV per variant and layer, the mean over seeds). The statistics are :mod:`eqmoe.analysis.ablation_stats`.
"""

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

from eqmoe.analysis.ablation_stats import ALPHA, LEVEL, POWER
from eqmoe.config import ModelConfig
from eqmoe.config_io import format_override, parse_override
from eqmoe.flops import model_flops_per_token
from eqmoe.train.logging import write_json_atomic
from eqmoe.train.loop import OutputOptions
from eqmoe.train.tracking import TrackerOptions
from experiments import pretrain
from experiments._ablation_options import AblationOptions, settings
from experiments._ablation_report import FLOP_TOLERANCE, plot_results, results_table, runs_of
from experiments._ablation_runs import (  # noqa: F401 (command: importable from here as before)
    command,
    compare_rows,
    compute_of,
    run_extras,
    run_record,
    train_or_read,
    variant_row,
)
from experiments._ablation_variants import BASE_OVERRIDES, matched_widths, read_variants_file
from experiments._cli import UsageError, guarded
from experiments.options import EvalOptions, MeshOptions, ShapeOptions, StartOptions, TokenizerOption, import_modules

_GROUPS = {"moe.router.num_groups": 8}

# The built-in variants, each on BASE_OVERRIDES (experiments/_ablation_variants.py).
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
class Args(
    AblationOptions,
    StartOptions,
    ShapeOptions,
    TokenizerOption,
    MeshOptions,
    TrackerOptions,
    OutputOptions,
    EvalOptions,
):
    """Every variant starts from the same model (``--preset`` or ``--init-from-*``, with ``--override``) and trains
    on the same data; the variants differ only in their own overrides."""

    wandb_project: str = "eqmoe-ablate"
    out_dir: Path = Path("runs/ablate")


def variant_table(args: Args) -> dict[str, dict[str, object]]:
    """Every variant by name: :data:`VARIANTS` and those of ``--variants-file``."""
    return {**VARIANTS, **(read_variants_file(args.variants_file, VARIANTS) if args.variants_file is not None else {})}


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


def seeds_of(args: Args) -> list[int]:
    """``--seed``, ``--seed + 1``, ... : ``--seeds`` of them, the same for every variant."""
    return list(range(args.seed, args.seed + args.seeds))


def run_folder(args: Args, name: str, seed: int) -> Path:
    """``--out-dir/NAME/seed-S``; for seed ``--seed``, ``--out-dir/NAME`` when it holds a run of before seeds."""
    variant_folder = args.out_dir / name
    if seed == args.seed and any((variant_folder / output).exists() for output in ("summary.json", "checkpoints")):
        return variant_folder
    return variant_folder / f"seed-{seed}"


def pretrain_args(
    args: Args, name: str, table: dict[str, dict[str, object]] | None = None, seed: int | None = None
) -> pretrain.Args:
    """The ``experiments.pretrain`` arguments of variant ``name`` (of ``table``, default :data:`VARIANTS`) with
    ``seed`` (default ``--seed``)."""
    seed = args.seed if seed is None else seed
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
            out_dir=run_folder(args, name, seed),
            checkpoint_every=args.checkpoint_every,
            eval_every=args.eval_every,
            log_every=min(50, args.steps),
            seed=seed,
            tracker=args.tracker,
            wandb_project=args.wandb_project,
        ),
        parallel=MeshOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(MeshOptions)}),
        eval=EvalOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EvalOptions)}),
    )


# --- checks before anything trains ------------------------------------------------------------------------------


def _as_recorded(overrides: dict[str, object]) -> dict[str, object]:
    """``overrides`` as a pretrain summary records them (through their ``FIELD.PATH=VALUE`` text)."""
    return dict(parse_override(format_override(path, value)) for path, value in overrides.items())


def variant_configs(args: Args, table: dict[str, dict[str, object]], names: list[str]) -> dict[str, ModelConfig]:
    """The config of the baseline, of every variant to run and of every variant in the file: a bad field or value,
    or one that would reshape a loaded model, is a ``UsageError`` naming the variant."""
    start = pretrain.start_config(pretrain_args(args, "baseline", table).model)
    configs = {}
    for name in dict.fromkeys(["baseline", *names, *(name for name in table if name not in VARIANTS)]):
        try:
            configs[name] = pretrain.model_config(pretrain_args(args, name, table).model, start)
        except (ValueError, UsageError) as error:
            where = "" if name in VARIANTS else f"--variants-file {args.variants_file}: "
            raise UsageError(f"{where}variant {name!r}: {error}") from None
    return configs


def check_variants(args: Args, table: dict[str, dict[str, object]], names: list[str]) -> dict[str, ModelConfig]:
    """:func:`variant_configs`, and every run that finished before must have finished with its variant's overrides
    of now (else its row would report another run)."""
    configs = variant_configs(args, table, names)
    given = dict(parse_override(text) for text in args.override)  # --override, before the variant's own
    for name in names:
        for seed in seeds_of(args):
            folder = run_folder(args, name, seed)
            if not (folder / "summary.json").is_file():
                continue
            recorded = json.loads((folder / "summary.json").read_text()).get("overrides")
            if recorded != {**given, **_as_recorded({**BASE_OVERRIDES, **table[name]})}:
                raise UsageError(
                    f"variant {name!r} finished in {folder} with other overrides {json.dumps(recorded)} "
                    f"(now {json.dumps(table[name])} on the base); rename it, or use another --out-dir"
                )
    return configs


# --- the grid ---------------------------------------------------------------------------------------------------


def _resolve_widths(
    args: Args, table: dict[str, dict[str, object]], names: list[str]
) -> tuple[dict[str, dict[str, object]], dict[str, str]]:
    """The table with ``--match active-flops``'s widths in the variants' overrides, and where each variant's
    ``moe.expert_dim`` comes from (``base``, ``variant`` or ``match``)."""
    origin = {name: "variant" if "moe.expert_dim" in table[name] else "base" for name in table}
    if args.match == "tokens":
        return table, origin
    configs = variant_configs(args, table, names)
    if configs["baseline"].moe is None:
        raise UsageError("--match active-flops: the baseline has no MoE layer, no expert width to match")
    widths = matched_widths(table, names, configs, args.seq_len)
    resolved = {
        name: {**overrides, **({"moe.expert_dim": widths[name]} if name in widths else {})}
        for name, overrides in table.items()
    }
    return resolved, {**origin, **dict.fromkeys(widths, "match")}


def _report_widths(names: list[str], configs: dict[str, ModelConfig], origin: dict[str, str], seq_len: int) -> None:
    target = model_flops_per_token(configs["baseline"], seq_len)
    print("--match active-flops: moe.expert_dim and FLOPs per token vs the baseline's", file=sys.stderr)
    for name in names:
        config = configs[name]
        gap = model_flops_per_token(config, seq_len) / target - 1
        width = "–" if config.moe is None else config.moe.expert_dim
        note = f" (beyond {FLOP_TOLERANCE:.0%})" if abs(gap) > FLOP_TOLERANCE else ""
        print(f"  {name}: {width} ({origin[name]}), {gap:+.2%}{note}", file=sys.stderr)


def _print_plan(args: Args, table: dict[str, dict[str, object]], names: list[str]) -> None:
    seeds = seeds_of(args)
    print(f"--dry-run: {len(names)} variants x {len(seeds)} seeds into {args.out_dir}", file=sys.stderr)
    for name in names:
        states = []
        for seed in seeds:
            folder = run_folder(args, name, seed)
            finished, interrupted = (folder / "summary.json").is_file(), (folder / "checkpoints").is_dir()
            states.append(f"{seed} " + ("finished" if finished else "resumes" if interrupted else "to train"))
        print(f"  {name} {json.dumps(table[name])}: seeds {', '.join(states)}", file=sys.stderr)


def run(args: Args) -> dict:
    import_modules(args.import_modules)  # before any config is checked: what it registers is nameable
    if args.seeds < 1:
        raise UsageError(f"--seeds {args.seeds}: allowed: an integer >= 1")
    table = variant_table(args)
    names = chosen_variants(args, table)
    table, origin = _resolve_widths(args, table, names)
    configs = check_variants(args, table, names)
    if args.match == "active-flops":
        _report_widths(names, configs, origin, args.seq_len)
    settings_path = args.out_dir / "ablation.json"
    if settings_path.is_file() and json.loads(settings_path.read_text()) != settings(args):
        raise UsageError(
            f"{args.out_dir} holds an ablation with other settings ({settings_path}); use another --out-dir"
        )
    if args.dry_run:
        _print_plan(args, table, names)
        return {}
    write_json_atomic(settings_path, settings(args))
    results_path = args.out_dir / "results.json"
    previous = json.loads(results_path.read_text())["variants"] if results_path.is_file() else {}
    seeds = seeds_of(args)
    runs: dict[str, dict[int, dict]] = {name: {} for name in names}
    for number, (seed, name) in enumerate(((s, n) for s in seeds for n in names), start=1):  # a whole grid per seed
        variant = pretrain_args(args, name, table, seed)
        summary = train_or_read(variant, f"[{number}/{len(runs) * len(seeds)}] {name} seed {seed}", table[name])
        runs[name][seed] = run_record(variant, summary, run_extras(variant, summary))
    rows = {
        name: variant_row(row["overrides"], runs_of(row, args.seed), row.get("compute"))
        for name, row in previous.items()
    }
    for name in names:
        compute = compute_of(configs[name], configs["baseline"], args.seq_len, origin[name])
        rows[name] = variant_row(table[name], runs[name], compute)
    results = {
        "settings": settings(args),
        "base_overrides": BASE_OVERRIDES,
        "imports": list(args.import_modules),
        "seeds": seeds,
        "match": args.match,
        "level": LEVEL,
        "alpha": ALPHA,
        "power": POWER,
        "noise_floor": compare_rows(rows),
        "variants": rows,
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
    if results:  # empty after --dry-run
        print(results_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
