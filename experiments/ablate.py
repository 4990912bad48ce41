"""Router and norm ablations: every variant trained with the same seed, data order and token budget.

    python -m experiments.ablate                                  # the default grid, ~9 min on 2 CPU cores
    python -m experiments.ablate --variants baseline switch-top1  # a subset
    python -m experiments.ablate --steps 1000 --out-dir runs/ablate-long

A variant is a named set of config overrides on the base (``--preset`` plus :data:`BASE_OVERRIDES`);
add one with one line in :data:`VARIANTS`. Each variant is an ``experiments.pretrain`` run in
``--out-dir/NAME``: a variant with a ``summary.json`` is skipped, and one that was interrupted resumes
from its last checkpoint. Outputs: ``results.md`` (the table and, per row, the ``pretrain`` command
that reproduces it), ``results.json`` (every figure, per layer too, and each variant's overrides),
``eval_loss.png`` (eval loss against tokens seen) and ``load_balance.png`` (load CV per variant and layer).
"""

import dataclasses
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

from eqmoe.config_io import format_override
from eqmoe.train.logging import new_figure, save_figure, write_json_atomic
from eqmoe.train.tracking import TrackerName
from experiments import pretrain
from experiments._cli import UsageError, guarded

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
class Args:
    variants: tuple[str, ...] = ()
    """Variants to run, by name (default: all of VARIANTS)."""
    out_dir: Path = Path("runs/ablate")
    """Results go here; each variant's run in OUT_DIR/NAME."""
    preset: str = "qwen3-moe-micro"
    """Base model preset."""
    steps: int = 300
    """Optimizer steps per variant."""
    batch_size: int = 16
    """Rows per step."""
    seq_len: int = 128
    """Tokens per row."""
    learning_rate: float = 3e-3
    """Peak learning rate (50 warmup steps, cosine to a tenth at the last step)."""
    eval_every: int = 50
    """Evaluate every N steps (the eval-loss curve's resolution)."""
    checkpoint_every: int = 50
    """Checkpoint every N steps: at most this many steps are redone after an interruption."""
    seed: int = 0
    """Seed for parameters, data and data order, the same for every variant."""
    chars_per_domain: int = 400_000
    """Built-in corpus: training characters of each domain."""
    eval_chars_per_domain: int = 10_000
    """Built-in corpus: held-out characters of each domain."""
    mesh: str | None = None
    """Device mesh for every variant, e.g. data=2,expert=4 (default: one device)."""
    tracker: tuple[TrackerName, ...] = ("jsonl",)
    """Trackers of every variant's run besides metrics.jsonl: tensorboard, wandb (one run per variant)."""
    wandb_project: str = "eqmoe-ablate"
    """W&B project of --tracker wandb."""


def settings(args: Args) -> dict:
    """What every variant shares; an output folder holds results of one setting only."""
    fields = dataclasses.asdict(args)
    views = ("variants", "out_dir", "mesh", "tracker", "wandb_project")
    return {name: value for name, value in fields.items() if name not in views}


def pretrain_args(args: Args, name: str) -> pretrain.Args:
    """The ``experiments.pretrain`` arguments of variant ``name``."""
    overrides = {**BASE_OVERRIDES, **VARIANTS[name]}
    defaults = pretrain.Args()
    return pretrain.Args(
        model=dataclasses.replace(
            defaults.model, preset=args.preset, override=tuple(format_override(k, v) for k, v in overrides.items())
        ),
        data=dataclasses.replace(
            defaults.data,
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
        parallel=dataclasses.replace(defaults.parallel, mesh=args.mesh),
    )


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
            if isinstance(chosen, bool):
                words.append(flag if chosen else "--no-" + flag[2:])
            elif isinstance(chosen, tuple):
                words += [flag, *map(str, chosen)]
            else:
                words += [flag, str(chosen)]
    return shlex.join(words)


def _variant_record(name: str, args: pretrain.Args, summary: dict) -> dict:
    records = [json.loads(line) for line in (args.run.out_dir / "metrics.jsonl").read_text().splitlines() if line]
    tokens_per_step = args.data.batch_size * args.data.seq_len
    curve = [[r["step"] * tokens_per_step, r["eval_loss"]] for r in records if "eval_loss" in r]
    return {
        "overrides": VARIANTS[name],
        "all_overrides": {**BASE_OVERRIDES, **VARIANTS[name]},
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
    lines = [
        f"# Ablation on {run['preset']}: {run['steps']} steps x {run['batch_size']} x {run['seq_len']} tokens, "
        f"seed {run['seed']}",
        "",
        f"Base overrides: `{json.dumps(BASE_OVERRIDES)}`. Routing figures are on the held-out set at the end, averaged "
        "over MoE layers; NMI is the normalised mutual information of expert choice and data domain.",
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


def run(args: Args) -> dict:
    unknown = [name for name in args.variants if name not in VARIANTS]
    if unknown:
        raise UsageError(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    names = list(args.variants) or list(VARIANTS)
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
        variant_args = pretrain_args(args, name)
        summary_path = variant_args.run.out_dir / "summary.json"
        if summary_path.is_file():
            print(f"[{number}/{len(names)}] {name}: finished before, skipped", file=sys.stderr)
            summary = json.loads(summary_path.read_text())
        else:
            print(f"[{number}/{len(names)}] {name}: {json.dumps(VARIANTS[name])}", file=sys.stderr)
            interrupted = (variant_args.run.out_dir / "checkpoints").is_dir()
            summary = pretrain.run(
                dataclasses.replace(variant_args, run=dataclasses.replace(variant_args.run, resume=interrupted))
            )
        variants[name] = _variant_record(name, variant_args, summary)
    results = {"settings": settings(args), "base_overrides": BASE_OVERRIDES, "variants": {**previous, **variants}}
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
