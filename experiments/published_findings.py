"""Five published MoE findings re-run at this scale, each claim judged by its paired interval over seeds.

    python -m experiments.published_findings                      # ~25-60 min on 2 CPU cores
    python -m experiments.published_findings --findings granularity --max-seeds 5

Every arm is an :mod:`experiments.ablate` variant of the same base (:data:`BASE_OVERRIDE`), trained over the same
seeds (paired) with ``--match active-flops`` (a variant that changes the experts' count, top-k or a shared expert
gets the ``expert_dim`` that brings its model FLOPs per token closest to the baseline's). A claim compares one
metric of two arms and reads:

- **reproduced**: the paired difference holds after Holm's correction over every claim, in the published direction;
- **opposite**: it holds in the other direction;
- **does not reproduce at this scale**: no difference, and the smallest difference the comparison could detect
  (80% power at 5%) is at most half the published effect;
- **inconclusive**: no difference, and the comparison could not have detected half the published effect; then
  seeds are added (``--seeds``, 5, then ``--max-seeds``) and the claim judged again;
- **no difference detected**: the source gives a direction only, and the interval holds zero.

Outputs in ``--out-dir``: the ablation's own (``results.md``, ``results.json``, the runs), ``findings.json`` and
``findings.md`` (the table: finding, source, our result with its interval, verdict).
"""

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

from eqmoe.analysis.ablation_stats import ALPHA, holm, paired_difference
from eqmoe.train.logging import write_json_atomic
from eqmoe.train.loop import OutputOptions
from experiments import ablate
from experiments._cli import guarded
from experiments.options import ShapeOptions

FindingName = Literal["aux-loss-free", "granularity", "dropless", "shared-expert", "global-batch-balance"]


@dataclass(frozen=True)
class Claim:
    """``variant``'s ``metric`` minus ``reference``'s, expected of sign ``direction`` (-1: lower); ``published``:
    the size of that difference in the source, in the metric's units (``None``: a direction only)."""

    text: str
    metric: str
    variant: str
    reference: str
    direction: int
    published: float | None
    published_note: str


@dataclass(frozen=True)
class Finding:
    name: str
    source: str
    variants: dict[str, dict[str, object]]
    claims: tuple[Claim, ...]


SIGMOID = {"moe.router.strategy": "sigmoid_top_k"}
FINDINGS = (
    Finding(
        "aux-loss-free",
        "Wang et al. 2024 (arXiv 2408.15664), Table 2: 1B MoE, 100B tokens",
        {
            "sigmoid-aux-loss": SIGMOID,
            "sigmoid-loss-free": {**SIGMOID, "moe.router.bias_update_rate": 0.001, "loss.load_balance_weight": 0.0},
        },
        (
            Claim(
                "loss-free balancing lowers MaxVio",
                "max_vio",
                "sigmoid-loss-free",
                "sigmoid-aux-loss",
                -1,
                0.68,
                "MaxVio_global 0.72 -> 0.04",
            ),
            Claim(
                "loss-free balancing lowers eval loss",
                "eval_loss",
                "sigmoid-loss-free",
                "sigmoid-aux-loss",
                -1,
                0.0063,
                "perplexity 9.56 -> 9.50",
            ),
        ),
    ),
    Finding(
        "granularity",
        "Krajewski et al. 2024 (arXiv 2402.07871), Table 1's fitted law at 1.6B; OLMoE (arXiv 2409.02060) Fig. 5",
        {
            "granularity-2x": {"moe.router.num_experts": 16, "moe.router.top_k": 4},
            "granularity-4x": {"moe.router.num_experts": 32, "moe.router.top_k": 8},
            "granularity-8x": {"moe.router.num_experts": 64, "moe.router.top_k": 16},
        },
        tuple(
            Claim(
                f"{factor}x finer experts (top-k alike, equal FLOPs) lower eval loss",
                "eval_loss",
                f"granularity-{factor}x",
                "baseline",
                -1,
                effect,
                "fitted, not measured pairs",
            )
            for factor, effect in ((2, 0.061), (4, 0.102), (8, 0.129))
        ),
    ),
    Finding(
        "dropless",
        "Fedus et al. 2021 (Switch, arXiv 2101.03961) Table 1: capacity factors 1.0 / 1.25 / 2.0; OLMoE Fig. 7",
        {
            "capacity-1.0": {"moe.router.capacity_factor": 1.0},
            "capacity-1.25": {"moe.router.capacity_factor": 1.25},
        },
        (
            Claim(
                "capacity factor 1.0 raises eval loss over dropless",
                "eval_loss",
                "capacity-1.0",
                "baseline",
                1,
                0.025,
                "top-2 MoE, capacity 1.0 vs 2.0 (the nearest to dropless)",
            ),
            Claim(
                "capacity factor 1.0 raises eval loss over 1.25",
                "eval_loss",
                "capacity-1.0",
                "capacity-1.25",
                1,
                0.008,
                "Switch-Base, -1.561 vs -1.553 neg. log perplexity",
            ),
        ),
    ),
    Finding(
        "shared-expert",
        "DeepSeekMoE (arXiv 2401.06066) Sec. 4.4: shared better; OLMoE Fig. 6: shared slightly worse",
        {"shared-expert-top1": {"moe.shared_experts": 1, "moe.router.top_k": 1}},
        (
            Claim(
                "one shared expert + top-1 (equal active compute) lowers eval loss vs top-2",
                "eval_loss",
                "shared-expert-top1",
                "baseline",
                -1,
                None,
                "the two sources disagree",
            ),
        ),
    ),
    Finding(
        "global-batch-balance",
        "Qiu et al. 2025 (arXiv 2501.11873) Table 1: 3.4B (0.6B active), 120B tokens",
        {"micro-batch-balance": {"loss.load_balance": "micro_batch", "loss.balance_micro_batch_rows": 1}},
        (
            Claim(
                "micro-batch (1 sequence) balance raises eval loss over the global batch's",
                "eval_loss",
                "micro-batch-balance",
                "baseline",
                1,
                0.016,
                "avg perplexity 8.167 vs 8.038",
            ),
            Claim(
                "micro-batch balance lowers domain specialisation (NMI)",
                "domain_nmi",
                "micro-batch-balance",
                "baseline",
                -1,
                None,
                "Fig. 1b: experts specialise by domain under the global batch",
            ),
        ),
    ),
)
_SEED_STEPS = (3, 5, 8)
# Every arm's base: ablate's (qwen3-moe-micro, load-balance weight 0.01) with experts of width 128, so that 4x finer
# experts (width 32) still have a multiple of 8 within 2% of the baseline's FLOPs once their larger router is paid
# for (at width 64 the 4x arm misses by 2.8%).
BASE_OVERRIDE = ("moe.expert_dim=128",)


@dataclass(frozen=True)
class Args(ShapeOptions, OutputOptions):
    """Which findings, how many seeds, and the ablation's budget (as ``ablate``'s: 300 steps of 16 x 128 tokens)."""

    out_dir: Path = Path("runs/published-findings")
    findings: tuple[FindingName, ...] = ()
    """Findings to run (default: all five)."""
    seeds: int = 3
    """Seeds every arm runs first."""
    max_seeds: int = 8
    """Seeds an inconclusive claim's arms may grow to (through 5)."""
    seed: int = 0
    """The first seed (the others follow it)."""
    steps: int = 300
    """Optimizer steps per run."""
    eval_every: int = 50
    """Evaluate every N steps."""
    checkpoint_every: int = 50
    """Checkpoint every N steps."""
    chars_per_domain: int = 400_000
    """Built-in corpus: training characters of each domain."""
    eval_chars_per_domain: int = 10_000
    """Built-in corpus: held-out characters of each domain."""


def chosen(args: Args) -> list[Finding]:
    return [f for f in FINDINGS if not args.findings or f.name in args.findings]


def _ablation(args: Args, names: list[str], seeds: int, variants_file: Path) -> ablate.Args:
    return ablate.Args(
        variants=("baseline", *names),
        variants_file=variants_file,
        out_dir=args.out_dir,
        seeds=seeds,
        seed=args.seed,
        match="active-flops",
        override=BASE_OVERRIDE,
        steps=args.steps,
        eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        chars_per_domain=args.chars_per_domain,
        eval_chars_per_domain=args.eval_chars_per_domain,
    )


def judge(claims: list[tuple[Finding, Claim]], variants: dict[str, dict]) -> list[dict]:
    """Each claim's paired difference over the seeds both arms ran, and its verdict (Holm over the claims)."""
    rows = []
    for finding, claim in claims:
        runs = {name: variants[name]["runs"] for name in (claim.variant, claim.reference)}
        seeds = sorted(set(runs[claim.variant]) & set(runs[claim.reference]), key=int)
        pairs = [(runs[claim.variant][s].get(claim.metric), runs[claim.reference][s].get(claim.metric)) for s in seeds]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        difference = paired_difference([a for a, _ in pairs], [b for _, b in pairs]) if pairs else None
        rows.append(
            {
                "finding": finding.name,
                "source": finding.source,
                "claim": claim.text,
                "metric": claim.metric,
                "variant": claim.variant,
                "reference": claim.reference,
                "direction": claim.direction,
                "published": claim.published,
                "published_note": claim.published_note,
                "variant_mean": _mean(a for a, _ in pairs),
                "reference_mean": _mean(b for _, b in pairs),
                "difference": None if difference is None else difference._asdict(),
            }
        )
    p_values = [row["difference"]["p_value"] if row["difference"] else None for row in rows]
    for row, holds in zip(rows, holm(p_values, ALPHA), strict=True):
        row["holds_after_holm"] = bool(holds)
        row["verdict"] = verdict(row)
    return rows


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def verdict(row: dict) -> str:
    difference = row["difference"]
    if difference is None or difference["n"] < 2:
        return "too few seeds"
    if row["holds_after_holm"]:
        return "reproduced" if difference["mean"] * row["direction"] > 0 else "opposite"
    if row["published"] is None:
        return "no difference detected"
    if difference["min_detectable"] <= row["published"] / 2:
        return "does not reproduce at this scale"
    return "inconclusive"


def run(args: Args) -> dict:
    findings = chosen(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    variants_file = args.out_dir / "findings_variants.json"
    table = {name: overrides for f in findings for name, overrides in f.variants.items()}
    write_json_atomic(variants_file, table)
    claims = [(f, c) for f in findings for c in f.claims]
    names, seeds = list(table), args.seeds
    while True:
        results = ablate.run(_ablation(args, names, seeds, variants_file))
        rows = judge(claims, results["variants"])
        pending = [row for row in rows if row["verdict"] == "inconclusive"]
        more = [s for s in (*_SEED_STEPS, args.max_seeds) if seeds < s <= args.max_seeds]
        if not pending or not more:
            break
        seeds = more[0]
        names = sorted({name for row in pending for name in (row["variant"], row["reference"]) if name != "baseline"})
        print(
            f"published findings: {len(pending)} inconclusive claim(s); their arms go to {seeds} seeds", file=sys.stderr
        )
    arms = {name: _arm(results["variants"][name]) for name in ("baseline", *table)}
    report = {"settings": dataclasses.asdict(args) | {"out_dir": str(args.out_dir)}, "claims": rows, "arms": arms}
    write_json_atomic(args.out_dir / "findings.json", report)
    (args.out_dir / ".findings.md.tmp").write_text(findings_table(report))
    (args.out_dir / ".findings.md.tmp").replace(args.out_dir / "findings.md")
    return report


def _arm(row: dict) -> dict:
    """An arm's figures for the findings report: its overrides, seeds, intervals and compute."""
    keep = ("overrides", "seeds", "stats", "compute", "domain_nmi", "eval_loss", "max_vio", "dropped_fraction")
    return {key: row.get(key) for key in keep}


def _interval(difference: dict | None, digits: int = 3) -> str:
    if difference is None:
        return "–"
    if difference["low"] is None:
        return f"{difference['mean']:+.{digits}f} (n=1)"
    return (
        f"{difference['mean']:+.{digits}f} [{difference['low']:+.{digits}f}, {difference['high']:+.{digits}f}] "
        f"(n={difference['n']}, detectable {difference['min_detectable']:.{digits}f})"
    )


def findings_table(report: dict) -> str:
    lines = [
        "| finding | claim | source (published effect) | ours: variant - reference, 95% CI | verdict |",
        "|---|---|---|---|---|",
    ]
    for row in report["claims"]:
        published = "direction only" if row["published"] is None else f"effect {row['published']:g}"
        lines.append(
            f"| {row['finding']} | {row['claim']} ({row['metric']}) | {row['source']} ({published}: "
            f"{row['published_note']}) | {_interval(row['difference'])} | {row['verdict']} |"
        )
    lines += [
        "",
        "Differences are paired by seed. Verdicts: reproduced / opposite = the difference holds after Holm's "
        "correction over every claim; does not reproduce at this scale = it does not, and the smallest detectable "
        "difference (80% power, 5% two-sided) is at most half the published effect; inconclusive = it could not "
        "have detected that; no difference detected = a direction-only source and an interval holding zero.",
    ]
    return "\n".join(lines) + "\n"


def main(args: Args) -> int:
    report = guarded("published_findings", run, args)
    if report is None:
        return 2
    print(findings_table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(tyro.cli(Args)))
