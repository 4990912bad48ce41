"""What ``experiments.ablate`` writes for people: ``results.md`` (the table, its explanation, the compute and the
reproducing commands) and the figures, all from ``results.json``'s figures alone."""

import json
from pathlib import Path

import numpy as np

from eqmoe.analysis.ablation_stats import ALPHA, LEVEL, POWER, curve_intervals
from eqmoe.train.logging import new_figure, save_figure

FLOP_TOLERANCE = 0.02  # the FLOP gap to the baseline --match active-flops aims within
WIDTH_STEP = 8  # matched expert widths are multiples of this


def runs_of(row: dict, seed: int) -> dict[int, dict]:
    """A ``results.json`` row's runs by seed; a row written before seeds is one run, of ``seed``."""
    return {int(s): run for s, run in row["runs"].items()} if "runs" in row else {seed: row}


def _cell(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    return "inf" if value == float("inf") else f"{value:.{digits}f}"


def _estimate(stat: dict | None, digits: int = 3) -> str:
    """The mean ± the half-width of its interval (the mean alone from one seed)."""
    if stat is None or stat["low"] is None:
        return _cell(None if stat is None else stat["mean"], digits)
    return f"{stat['mean']:.{digits}f} ± {(stat['high'] - stat['low']) / 2:.{digits}f}"


def _versus(compared: dict | None) -> str:
    if compared is None:
        return ""
    if compared["low"] is None:
        return f"{compared['mean']:+.3f} (n=1)"
    mark = " *" if compared["holds"] else ""
    return f"{compared['mean']:+.3f} [{compared['low']:+.3f}, {compared['high']:+.3f}]{mark}"


def _seeds_text(seeds: list[int]) -> str:
    return f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {', '.join(map(str, seeds))}"


def _explanation(results: dict) -> list[str]:
    compared = [row["vs_baseline"] for row in results["variants"].values() if row.get("vs_baseline")]
    tested = sum(row["p_value"] is not None for row in compared)
    floor = results.get("noise_floor")
    lines = [
        f"Each figure is the mean over seeds ± the half-width of its {LEVEL:.0%} t-interval (t_{{0.975,n-1}} sd / "
        "√n; the mean alone from one seed). A seed sets the initial parameters, the data order and the built-in "
        "corpus' text together, the same seeds for every variant, so *vs baseline* is the mean paired difference "
        f"variant − baseline over their common seeds with its {LEVEL:.0%} t-interval (n=1: no interval). "
        + (
            f"* marks a difference whose two-sided paired t-test passes Holm's correction at {ALPHA} over the "
            f"{tested} compared variants. "
            if tested
            else "No comparison has two seeds: nothing is tested. "
        )
        + f"*Detectable* is the smallest paired difference the comparison would find with {POWER:.0%} power at "
        f"{ALPHA} two-sided: (t_{{0.975,n-1}} + t_{{0.8,n-1}}) sd_diff / √n, sd_diff the spread of the per-seed "
        "differences.",
    ]
    if floor is not None and floor["eval_loss_sd"] is not None:
        lines += [
            "",
            f"Noise floor: the baseline's eval loss has sd {floor['eval_loss_sd']:.4f} over its "
            f"{floor['seeds']} seeds.",
        ]
    elif floor is not None:
        lines += ["", "Noise floor: unknown, the baseline ran with one seed."]
    return lines


def results_table(results: dict) -> str:
    """``results.md``: per variant its figures over seeds and its difference to the baseline, per-domain losses,
    compute, then the command reproducing each run."""
    run = results["settings"]
    rows = results["variants"]
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
    seeds = results.get("seeds", [run["seed"]])
    lines = [
        f"# Ablation {model}: {run['steps']} steps x {run['batch_size']} x {run['seq_len']} tokens, "
        f"{_seeds_text(seeds)}",
        "",
        f"Base overrides: `{json.dumps(results.get('base_overrides', {}))}`. "
        "Routing figures are on the held-out set at the end, averaged over MoE layers; MaxVio is the most loaded "
        "expert's load over the mean load, minus 1; NMI is the normalised mutual information of expert choice and "
        "data domain.",
        *(["", " ".join(inputs)] if inputs else []),
        "",
        *_explanation(results),
        "",
        "| variant | seeds | eval loss | vs baseline | detectable | load CV | MaxVio | dropped | router entropy "
        "| max/min load | domain NMI | tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        stats, compared = row.get("stats", {}), row.get("vs_baseline")
        detectable = None if compared is None else compared["min_detectable"]
        lines.append(
            f"| {name} | {len(row.get('seeds', [0]))} | {_estimate(stats.get('eval_loss'))} | {_versus(compared)} "
            f"| {_cell(detectable) if compared else ''} | {_estimate(stats.get('load_cv'))} "
            f"| {_estimate(stats.get('max_vio'))} | {_estimate(stats.get('dropped_fraction'))} "
            f"| {_estimate(stats.get('router_entropy'))} | {_cell(row['max_min_ratio'], 1)} "
            f"| {_cell(row['domain_nmi'])} | {row['tokens_per_second'] or 0:,.0f} |"
        )
    domains = list(dict.fromkeys(d for row in rows.values() for d in row.get("stats", {}).get("domain_loss", {})))
    if domains:
        lines += ["", "## Held-out loss per domain", "", f"| variant | {' | '.join(domains)} |"]
        lines.append("|---" * (len(domains) + 1) + "|")
        for name, row in rows.items():
            by_domain = row.get("stats", {}).get("domain_loss", {})
            lines.append(f"| {name} | {' | '.join(_estimate(by_domain.get(d)) for d in domains)} |")
    scores = list(dict.fromkeys(k for row in rows.values() for k in row.get("stats", {}).get("lm_eval", {})))
    if scores:  # --eval-tasks: each lm-eval score over seeds, with the same intervals
        lines += ["", "## lm-eval scores of the final models", "", f"| variant | {' | '.join(scores)} |"]
        lines.append("|---" * (len(scores) + 1) + "|")
        for name, row in rows.items():
            by_score = row.get("stats", {}).get("lm_eval", {})
            lines.append(f"| {name} | {' | '.join(_estimate(by_score.get(k), 4) for k in scores)} |")
    lines += _compute_table(results)
    lines += ["", "## Reproduce a run", ""]
    for name, row in rows.items():
        lines.append(f"- {name} (`{json.dumps(row['overrides'])}`):")
        for seed, run_row in row.get("runs", {"": row}).items():
            lines.append(f"  - {f'seed {seed}: ' if seed else ''}`{run_row['command']}`")
    return "\n".join(lines) + "\n"


def _compute_table(results: dict) -> list[str]:
    rows = {name: row["compute"] for name, row in results["variants"].items() if row.get("compute")}
    if not rows:
        return []
    match = results.get("match", "tokens")
    lines = [
        "",
        "## Compute",
        "",
        f"`--match {match}`: "
        + (
            "every variant trains on the same tokens."
            if match == "tokens"
            else f"every variant trains on the same tokens, its `moe.expert_dim` chosen (a multiple of {WIDTH_STEP}) "
            f"to bring its FLOPs per token closest to the baseline's; (!) marks a gap beyond {FLOP_TOLERANCE:.0%}."
        )
        + " FLOPs per token are a training step's model FLOPs (`eqmoe.flops.model_flops_per_token`); wall time is "
        "the mean over seeds of the process that trained each run (– for one resumed, or of before seeds).",
        "",
        "| variant | parameters | active | FLOPs/token | vs baseline | moe.expert_dim | tokens seen | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, compute in rows.items():
        gap = compute.get("flop_gap")
        beyond = " (!)" if gap is not None and abs(gap) > FLOP_TOLERANCE and match == "active-flops" else ""
        width = compute.get("expert_dim")
        source = {"match": " (matched)", "variant": " (its own)"}.get(compute.get("expert_dim_from"), "")
        lines.append(
            f"| {name} | {compute.get('total_parameters') or 0:,} | {compute.get('active_parameters') or 0:,} "
            f"| {(compute.get('flops_per_token') or 0) / 1e6:,.2f} M | {'' if gap is None else f'{gap:+.1%}'}{beyond} "
            f"| {'–' if width is None else width}{source} | {compute.get('tokens_seen') or 0:,.0f} "
            f"| {_cell(compute.get('wall_seconds'), 0)} |"
        )
    return lines


def plot_results(results: dict, out_dir: Path) -> None:
    """``eval_loss.png`` (the mean over seeds, a band for its interval) and ``load_balance.png`` (the mean)."""
    from matplotlib import colormaps

    variants = results["variants"]
    figure = new_figure(figsize=(9, 5.5))
    axis = figure.subplots()
    colors = colormaps["tab20"].colors
    for number, (name, row) in enumerate(variants.items()):
        tokens, intervals = curve_intervals(list(runs_of(row, 0).values()))
        mean, low, high = (np.asarray([getattr(i, field) for i in intervals]) for field in ("mean", "low", "high"))
        color = colors[number % len(colors)]
        style = "o-" if name == "baseline" else (".-" if number % 2 else ".--")
        axis.plot(tokens, mean, style, label=name, markersize=4, color=color)
        if len(row.get("seeds", [])) > 1:
            axis.fill_between(tokens, low, high, color=color, alpha=0.15, linewidth=0)
    axis.set_xlabel("tokens seen")
    axis.set_ylabel("eval loss (nats/token)")
    axis.set_yscale("log")
    axis.legend(fontsize=7, ncol=2)
    axis.set_title(f"held-out loss per variant (mean over seeds, band: {LEVEL:.0%} t-interval)")
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
        axis.set_title("expert load imbalance per variant and layer (mean over seeds)")
        figure.tight_layout()
        save_figure(figure, out_dir / "load_balance.png")
