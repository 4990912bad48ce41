"""Statistics of an ablation run over several seeds: means with t-intervals, paired differences to a baseline with
two-sided paired t-tests, Holm's step-down correction over the compared variants, and the smallest difference a
comparison could detect.

Pure Python and NumPy. Student's t distribution with an integer number of degrees of freedom has a closed form
(Abramowitz & Stegun 26.7.3 and 26.7.4, a finite sum in ``cos(atan(t / sqrt(df)))``), exact up to rounding; its
quantiles are found by bisection on it. Undefined figures (one seed: no spread) are ``None``, never NaN, so that
they survive JSON.
"""

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

LEVEL = 0.95  # of every interval
ALPHA = 0.05  # of every test, Holm's family-wise rate
POWER = 0.8  # of the minimum detectable difference

Numbers = Sequence[float] | np.ndarray


def t_central_mass(t: float, df: int) -> float:
    """``P(|T| <= t)`` for Student's t with ``df`` (an integer >= 1) degrees of freedom."""
    if df < 1 or int(df) != df:
        raise ValueError(f"df={df!r} is invalid; allowed: an integer >= 1")
    t = abs(float(t))
    if math.isinf(t):
        return 1.0
    theta = math.atan(t / math.sqrt(df))
    cosine, sine = math.cos(theta), math.sin(theta)
    if df % 2:  # odd: (2/pi) [theta + sin(theta) (cos + 2/3 cos^3 + 2*4/(3*5) cos^5 + ... + ... cos^(df-2))]
        term, total = cosine, 0.0
        for k in range(1, (df - 1) // 2 + 1):
            total += term
            term *= cosine**2 * (2 * k) / (2 * k + 1)
        return min(1.0, 2 / math.pi * (theta + sine * total))
    term, total = 1.0, 0.0  # even: sin(theta) (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ... + ... cos^(df-2))
    for k in range(1, df // 2 + 1):
        total += term
        term *= cosine**2 * (2 * k - 1) / (2 * k)
    return min(1.0, sine * total)


def t_quantile(probability: float, df: int) -> float:
    """The ``probability`` quantile of Student's t with ``df`` degrees of freedom (bisection on
    :func:`t_central_mass`, to the last bits of a float)."""
    if not 0 < probability < 1:
        raise ValueError(f"probability={probability!r} is invalid; allowed: strictly between 0 and 1")
    target = abs(2 * probability - 1)
    low, high = 0.0, 1.0
    while t_central_mass(high, df) < target:
        low, high = high, 2 * high
    for _ in range(200):
        middle = (low + high) / 2
        if middle in (low, high):
            break
        low, high = (middle, high) if t_central_mass(middle, df) < target else (low, middle)
    return math.copysign((low + high) / 2, probability - 0.5)


def two_sided_p_value(t: float, df: int) -> float:
    """``P(|T| >= |t|)`` under the null hypothesis of a t-test with ``df`` degrees of freedom."""
    return max(0.0, 1.0 - t_central_mass(t, df))


class MeanInterval(NamedTuple):
    """The mean of ``n`` values with its ``level`` t-interval; ``sd`` (with n - 1 in the denominator), ``low``
    and ``high`` are ``None`` for a single value."""

    n: int
    mean: float
    sd: float | None
    low: float | None
    high: float | None


def mean_interval(values: Numbers, level: float = LEVEL) -> MeanInterval:
    """``mean ± t_{(1 + level) / 2, n - 1} * sd / sqrt(n)``."""
    values = np.asarray(values, float)
    if values.ndim != 1 or not len(values):
        raise ValueError(f"expected a non-empty list of numbers, got {values.tolist()!r}")
    n, mean = len(values), float(values.mean())
    if n == 1:
        return MeanInterval(1, mean, None, None, None)
    sd = float(values.std(ddof=1))
    half = t_quantile((1 + level) / 2, n - 1) * sd / math.sqrt(n)
    return MeanInterval(n, mean, sd, mean - half, mean + half)


def minimum_detectable_difference(sd: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest true mean difference a two-sided paired t-test at ``alpha`` over ``n`` pairs finds with
    probability ``power``, when the differences spread by ``sd``: ``(t_{1 - alpha/2, n-1} + t_{power, n-1}) * sd
    / sqrt(n)`` (the usual normal-approximation formula with t quantiles)."""
    if n < 2:
        raise ValueError(f"n={n} is invalid; allowed: at least 2 pairs")
    return (t_quantile(1 - alpha / 2, n - 1) + t_quantile(power, n - 1)) * sd / math.sqrt(n)


class PairedDifference(NamedTuple):
    """``variant - baseline`` over ``n`` paired seeds: the mean difference with its t-interval, the two-sided
    paired t-test's p-value and the minimum detectable difference (``None`` each with a single pair)."""

    n: int
    mean: float
    sd: float | None
    low: float | None
    high: float | None
    p_value: float | None
    min_detectable: float | None


def paired_difference(
    variant: Numbers, baseline: Numbers, level: float = LEVEL, power: float = POWER
) -> PairedDifference:
    """Compare ``variant[i]`` with ``baseline[i]`` (the same seed ``i``)."""
    if len(variant) != len(baseline):
        raise ValueError(f"expected paired values, got {len(variant)} and {len(baseline)}")
    interval = mean_interval(np.asarray(variant, float) - np.asarray(baseline, float), level)
    if interval.n == 1:
        return PairedDifference(*interval, None, None)
    n, mean, sd = interval.n, interval.mean, interval.sd
    return PairedDifference(
        *interval, _paired_p_value(mean, sd, n), minimum_detectable_difference(sd, n, 1 - level, power)
    )


def _paired_p_value(mean: float, sd: float, n: int) -> float:
    if sd == 0:  # every pair differs by the same amount: no spread to weigh it against
        return 1.0 if mean == 0 else 0.0
    return two_sided_p_value(mean / (sd / math.sqrt(n)), n - 1)


def holm(p_values: Sequence[float | None], alpha: float = ALPHA) -> list[bool]:
    """Holm's step-down procedure: which hypotheses are rejected at family-wise rate ``alpha``. The ``m`` p-values
    that are not ``None`` are taken smallest first; the ``i``-th (from 0) is rejected while ``p <= alpha / (m -
    i)``, and none after the first that is not."""
    tested = sorted((p, index) for index, p in enumerate(p_values) if p is not None)
    rejected = [False] * len(p_values)
    for rank, (p, index) in enumerate(tested):
        if p > alpha / (len(tested) - rank):
            break
        rejected[index] = True
    return rejected


def compare_to_baseline(
    values: Mapping[str, Mapping[int, float]], baseline: str, level: float = LEVEL, alpha: float = ALPHA
) -> dict[str, dict | None]:
    """Every variant of ``values`` (name -> seed -> value) but ``baseline`` against it, over the seeds both have:
    :class:`PairedDifference` as a dict with ``holds``, whether it survives Holm's correction over every compared
    variant. ``None`` where the two share no seed."""
    reference = values.get(baseline, {})
    compared = {}
    for name, by_seed in values.items():
        seeds = sorted(set(by_seed) & set(reference))
        if name == baseline or not seeds:
            compared[name] = None
            continue
        difference = paired_difference([by_seed[s] for s in seeds], [reference[s] for s in seeds], level)
        compared[name] = {"seeds": seeds, **difference._asdict()}
    named = [name for name, result in compared.items() if result is not None]
    for name, holds in zip(named, holm([compared[name]["p_value"] for name in named], alpha), strict=True):
        compared[name]["holds"] = holds
    return compared


# --- a variant's runs over seeds ------------------------------------------------------------------------------------

# A run's figures (experiments.ablate's run records) averaged over seeds; the first also with their t-interval.
INTERVAL_FIGURES = ("eval_loss", "load_cv", "max_vio", "dropped_fraction", "router_entropy")
MEAN_FIGURES = ("final_train_loss", "max_min_ratio", "domain_nmi", "tokens_per_second")


def mean_of(values: Iterable[float | None]) -> float | None:
    """The mean of the values that are not ``None`` (``None``: there are none)."""
    known = [value for value in values if value is not None]
    return float(np.mean(known)) if known else None


def interval_of(values: Iterable[float | None], level: float = LEVEL) -> dict | None:
    """:func:`mean_interval` of the values that are not ``None``, as a dict (``None``: there are none)."""
    known = [value for value in values if value is not None]
    return mean_interval(known, level)._asdict() if known else None


def curve_intervals(runs: Sequence[Mapping], level: float = LEVEL) -> tuple[list[int], list[MeanInterval]]:
    """The runs' ``eval_curve`` (``[tokens, loss]`` pairs) over seeds: the token counts every run evaluated at and
    the :class:`MeanInterval` of the loss at each."""
    curves = [dict(run.get("eval_curve") or []) for run in runs]
    tokens = sorted(set(curves[0]).intersection(*curves[1:]))
    return tokens, [mean_interval([curve[count] for curve in curves], level) for count in tokens]


def summarize_runs(runs: Sequence[Mapping], level: float = LEVEL) -> dict:
    """One variant's runs (one per seed) together: the mean of every figure, the mean per-domain loss
    (``domain_loss``) and of every lm-eval score (``lm_eval``, ``"task/metric"``: ``--eval-tasks``), t-intervals of
    :data:`INTERVAL_FIGURES`, of each domain's loss and of each lm-eval score (``stats``), the mean
    eval-loss curve and the mean of every per-layer figure (``layers``; ``None`` unless every run has them)."""
    domain_losses = [run.get("domain_loss") or {} for run in runs]
    domains = list(dict.fromkeys(domain for losses in domain_losses for domain in losses))
    by_domain = {domain: [losses.get(domain) for losses in domain_losses] for domain in domains}
    tokens, intervals = curve_intervals(runs, level)
    layers = [run.get("layers") for run in runs]
    # lm-eval scores (--eval-tasks) as "task/metric", their standard errors left out: the interval is over seeds
    scores = [
        {
            f"{task}/{name}": value
            for task, values in (run.get("lm_eval") or {}).items()
            for name, value in values.items()
        }
        for run in runs
    ]
    score_names = [name for name in dict.fromkeys(k for s in scores for k in s) if not name.endswith("_stderr")]
    by_score = {name: [s.get(name) for s in scores] for name in score_names}
    return {
        **{key: mean_of(run.get(key) for run in runs) for key in INTERVAL_FIGURES + MEAN_FIGURES},
        "domain_loss": {domain: mean_of(values) for domain, values in by_domain.items()},
        "lm_eval": {name: mean_of(values) for name, values in by_score.items()},
        "stats": {
            **{key: interval_of((run.get(key) for run in runs), level) for key in INTERVAL_FIGURES},
            "domain_loss": {domain: interval_of(values, level) for domain, values in by_domain.items()},
            "lm_eval": {name: interval_of(values, level) for name, values in by_score.items()},
        },
        "eval_curve": [[count, interval.mean] for count, interval in zip(tokens, intervals, strict=True)],
        "layers": None
        if any(layer is None for layer in layers)
        else {
            key: np.mean([layer[key] for layer in layers], axis=0).tolist()
            for key in layers[0]
            if all(key in layer for layer in layers)  # a run of an older eqmoe may lack a newer figure
        },
    }
