"""One run of an ablation: trained (or read back when it finished before), its figures, the ``pretrain`` command
that reproduces it; and a variant's runs over seeds together as its row of ``results.json``."""

import dataclasses
import json
import shlex
import sys
import time

import numpy as np

from eqmoe.analysis.ablation_stats import ALPHA, LEVEL, compare_to_baseline, mean_of, summarize_runs
from eqmoe.analysis.params import count_parameters
from eqmoe.config import ModelConfig
from eqmoe.flops import model_flops_per_token
from eqmoe.train.logging import write_json_atomic
from experiments import pretrain
from experiments._ablation_report import runs_of
from experiments._ablation_variants import BASE_OVERRIDES

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


# --- one run: train or read it ----------------------------------------------------------------------------------

RUN_EXTRAS = "ablation_run.json"  # beside a run's summary: its wall time and per-domain held-out loss


def train_or_read(variant: pretrain.Args, label: str, overrides: dict[str, object]) -> dict:
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
    from eqmoe.analysis.routing_maps import domain_routing
    from eqmoe.analysis.routing_records import RoutingRecorder, concat_records, moe_layer_numbers
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


def run_extras(variant: pretrain.Args, summary: dict) -> dict:
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
        "lm_eval": summary.get("lm_eval"),  # --eval-tasks: {task: {metric: value}}
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
