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
import functools
import json
import math
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import tyro

from eqmoe.analysis.ablation_stats import (
    ALPHA,
    LEVEL,
    POWER,
    compare_to_baseline,
    mean_of,
    summarize_runs,
)
from eqmoe.analysis.params import count_parameters
from eqmoe.config import ModelConfig
from eqmoe.config_io import apply_overrides, format_override, parse_override
from eqmoe.flops import model_flops_per_token
from eqmoe.train.logging import write_json_atomic
from eqmoe.train.loop import OutputOptions
from eqmoe.train.tracking import TrackerOptions
from experiments import pretrain
from experiments._ablation_report import FLOP_TOLERANCE, WIDTH_STEP, plot_results, results_table, runs_of
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
    """First seed: the runs of every variant use seeds --seed, --seed + 1, ..., --seed + --seeds - 1."""
    seeds: int = 3
    """Seeds per variant; each sets the initial parameters, the data order and the built-in corpus' text together."""
    match: Literal["tokens", "active-flops"] = "tokens"
    """tokens: every variant trains on steps x batch x seq tokens. active-flops: also sets each variant's
    moe.expert_dim (a multiple of 8) to bring its FLOPs per token closest to the baseline's."""
    data: tuple[Path, ...] = ()
    """Text files (one document each) or JSONL files of {"text", "domain"} (default: the built-in corpus)."""
    chars_per_domain: int = 400_000
    """Built-in corpus: training characters of each domain."""
    eval_chars_per_domain: int = 10_000
    """Built-in corpus: held-out characters of each domain."""
    dry_run: bool = False
    """Check every variant and print the runs the grid holds (finished, to resume, to train) and, with --match
    active-flops, the widths and FLOP gaps; train and write nothing."""


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
    "match": "tokens",
}


def settings(args: Args) -> dict:
    """What every variant shares; an output folder holds results of one setting only. The number of seeds is not
    one: more seeds are more runs of the same setting."""
    fields = dataclasses.asdict(args)
    views = {f.name for f in dataclasses.fields(MeshOptions) + dataclasses.fields(TrackerOptions)}
    views |= {"variants", "out_dir", "variants_file", "import_modules", "seeds", "dry_run"}
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


# --- --match active-flops ---------------------------------------------------------------------------------------


def _flops(config: ModelConfig, seq_len: int, expert_dim: int | None = None) -> float:
    if expert_dim is not None:
        config = apply_overrides(config, {"moe.expert_dim": expert_dim})
    return model_flops_per_token(config, seq_len)


def matched_expert_dim(config: ModelConfig, target_flops: float, seq_len: int) -> int:
    """The ``moe.expert_dim``, a multiple of :data:`WIDTH_STEP` or ``config``'s own, whose model FLOPs per token at
    ``seq_len`` come closest to ``target_flops``. FLOPs grow linearly with the width, so two widths locate the
    answer and the multiples on either side of it are compared exactly."""
    own = config.moe.expert_dim
    flops = functools.cache(functools.partial(_flops, config, seq_len))
    slope = (flops(own + WIDTH_STEP) - flops(own)) / WIDTH_STEP
    if slope <= 0:  # no layer runs the routed experts: the width costs nothing
        return own
    estimate = own + (target_flops - flops(own)) / slope
    below = max(WIDTH_STEP, math.floor(estimate / WIDTH_STEP) * WIDTH_STEP)
    candidates = sorted({own, below, below + WIDTH_STEP})
    return min(candidates, key=lambda width: (abs(flops(width) - target_flops), width != own))


def matched_widths(
    table: dict[str, dict[str, object]], names: list[str], configs: dict[str, ModelConfig], seq_len: int
) -> dict[str, int]:
    """``--match active-flops``: the matched ``moe.expert_dim`` of each variant of ``names`` whose width changes
    (not the baseline's, not one a variant sets itself, not a model without MoE layers)."""
    target = model_flops_per_token(configs["baseline"], seq_len)
    widths = {}
    for name in names:
        config = configs[name]
        if name == "baseline" or config.moe is None or "moe.expert_dim" in table[name]:
            continue
        width = matched_expert_dim(config, target, seq_len)
        if width != config.moe.expert_dim:
            widths[name] = width
    return widths


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


# --- one run: train or read it ----------------------------------------------------------------------------------

RUN_EXTRAS = "ablation_run.json"  # beside a run's summary: its wall time and per-domain held-out loss


def _train_or_read(variant: pretrain.Args, label: str, overrides: dict[str, object]) -> dict:
    """The run's summary: read when it finished before, else trained (resumed when it was interrupted)."""
    folder = variant.run.out_dir
    if (folder / "summary.json").is_file():
        print(f"{label}: finished before, skipped", file=sys.stderr)
        return json.loads((folder / "summary.json").read_text())
    print(f"{label}: {json.dumps(overrides)}", file=sys.stderr)
    interrupted = (folder / "checkpoints").is_dir()
    started = time.perf_counter()
    summary = pretrain.run(dataclasses.replace(variant, run=dataclasses.replace(variant.run, resume=interrupted)))
    # An interrupted run's earlier part went unclocked: no wall time rather than a short one.
    write_json_atomic(folder / RUN_EXTRAS, {"wall_seconds": None if interrupted else time.perf_counter() - started})
    return summary


def held_out_domain_losses(variant: pretrain.Args, domains: list[str]) -> dict[str, float | None] | None:
    """The mean next-token loss of each domain's held-out tokens under the run's last checkpoint (``None``: no
    checkpoint, or no MoE layer to record)."""
    from eqmoe.analysis.routing_maps import RoutingRecorder, concat_records, domain_routing, moe_layer_numbers
    from eqmoe.checkpoints.model_checkpoint import load_model
    from eqmoe.data.corpus import pack_documents
    from eqmoe.lora import merge_lora

    checkpoints = variant.run.out_dir / "checkpoints"
    if not checkpoints.is_dir():
        return None
    model = merge_lora(load_model(checkpoints)[0])
    if not len(moe_layer_numbers(model.config)):
        return None
    _, documents, _ = pretrain._documents(variant.data, variant.run.seed)
    tokenizer = pretrain._tokenizer(variant)
    held_out = pack_documents(documents, tokenizer, variant.data.seq_len, domains=domains).packed
    recorder, batch_size, count = RoutingRecorder(model), variant.data.batch_size, len(held_out.rows.tokens)
    parts = []
    for start in range(0, count, batch_size):  # whole batches, the last filled with padding: one compilation
        index = np.arange(start, start + batch_size) % count
        real = (np.arange(batch_size) + start < count)[:, None]
        tokens, segments, positions, _ = (np.where(real, np.asarray(array)[index], 0) for array in held_out.rows)
        labels = np.where(real & (segments > 0), held_out.labels[index], -1)
        parts.append(
            recorder(tokens, segment_ids=segments, positions=positions, token_mask=segments > 0, domains=labels)
        )
    losses = domain_routing(concat_records(parts), len(domains)).loss
    return {domain: float(loss) if np.isfinite(loss) else None for domain, loss in zip(domains, losses, strict=True)}


def _run_extras(variant: pretrain.Args, summary: dict) -> dict:
    """The run's :data:`RUN_EXTRAS`, its per-domain losses computed once (a run of before seeds has none yet)."""
    path = variant.run.out_dir / RUN_EXTRAS
    extras = json.loads(path.read_text()) if path.is_file() else {}
    if "domain_loss" not in extras and summary.get("domains"):
        extras["domain_loss"] = held_out_domain_losses(variant, summary["domains"])
        write_json_atomic(path, extras)
    return extras


def run_record(variant: pretrain.Args, summary: dict, extras: dict) -> dict:
    """One run's figures: the held-out ones at its end, its eval-loss curve, compute and reproducing command."""
    lines = (variant.run.out_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line]
    tokens_per_step = summary.get("tokens_per_step", variant.data.batch_size * variant.data.seq_len)
    return {
        "seed": variant.run.seed,
        "command": command(variant),
        "eval_loss": summary["eval_loss"],
        "final_train_loss": summary["final_loss"],
        "load_cv": summary.get("eval_load_cv"),
        "max_min_ratio": summary.get("eval_max_min_ratio"),
        "max_vio": summary.get("eval_max_vio"),
        "dropped_fraction": summary.get("eval_dropped_fraction"),
        "router_entropy": summary.get("eval_router_entropy"),
        "domain_nmi": summary.get("eval_domain_nmi"),
        "domain_loss": extras.get("domain_loss"),
        "tokens_per_second": summary["tokens_per_second"],
        "tokens_seen": summary.get("steps", variant.run.steps) * tokens_per_step,
        "wall_seconds": extras.get("wall_seconds"),
        "eval_curve": [[r["step"] * tokens_per_step, r["eval_loss"]] for r in records if "eval_loss" in r],
        "layers": summary.get("layers"),
    }


# --- a variant's runs together ----------------------------------------------------------------------------------


def variant_row(overrides: dict[str, object], runs: dict[int, dict], compute: dict | None = None) -> dict:
    """A variant's row of ``results.json`` from its runs by seed: the means over seeds under the keys one run's
    figures have (as a results file of before seeds held them), their t-intervals (``stats``), the compute
    (``compute``, with the runs' mean tokens and wall time) and every run (``runs``, by seed)."""
    seeds = sorted(runs)
    ordered = [runs[seed] for seed in seeds]
    summary = summarize_runs(ordered)
    return {
        "overrides": overrides,
        "all_overrides": {**BASE_OVERRIDES, **overrides},
        "seeds": seeds,
        "command": ordered[0]["command"],
        **summary,
        "vs_baseline": None,
        "compute": {
            **(compute or {}),
            "tokens_seen": mean_of(run.get("tokens_seen") for run in ordered),
            "wall_seconds": mean_of(run.get("wall_seconds") for run in ordered),
        },
        "runs": {str(seed): runs[seed] for seed in seeds},
    }


def compare_rows(rows: dict[str, dict]) -> dict | None:
    """Fill each row's ``vs_baseline`` (the paired eval-loss difference, Holm over every compared row); the
    baseline's seed-to-seed spread of eval loss, the noise floor (``None`` without a baseline)."""
    eval_losses = {
        name: {seed: run["eval_loss"] for seed, run in runs_of(row, -1).items()} for name, row in rows.items()
    }
    for name, compared in compare_to_baseline(eval_losses, "baseline", LEVEL, ALPHA).items():
        rows[name]["vs_baseline"] = compared
    baseline = rows.get("baseline", {}).get("stats", {}).get("eval_loss")
    return None if baseline is None else {"eval_loss_sd": baseline["sd"], "seeds": baseline["n"]}


def compute_of(config: ModelConfig, baseline: ModelConfig, seq_len: int, expert_dim_from: str) -> dict:
    """Parameters, model FLOPs per token (a training step's, at ``seq_len``) and their gap to the baseline's."""
    total, active = count_parameters(config)
    flops = model_flops_per_token(config, seq_len)
    return {
        "total_parameters": total,
        "active_parameters": active,
        "flops_per_token": flops,
        "flop_gap": flops / model_flops_per_token(baseline, seq_len) - 1,
        "expert_dim": None if config.moe is None else config.moe.expert_dim,
        "expert_dim_from": expert_dim_from,
    }


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
        summary = _train_or_read(variant, f"[{number}/{len(runs) * len(seeds)}] {name} seed {seed}", table[name])
        runs[name][seed] = run_record(variant, summary, _run_extras(variant, summary))
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
