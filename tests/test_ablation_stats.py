"""The ablation statistics against standard tables and NumPy re-derivations written here, not from the module."""

import math

import numpy as np
import pytest

from eqmoe.analysis.ablation_stats import (
    compare_to_baseline,
    holm,
    mean_interval,
    minimum_detectable_difference,
    paired_difference,
    summarize_runs,
    t_quantile,
    two_sided_p_value,
)

# Student's t quantiles t_{q, df} as printed in standard tables.
TABLE = {
    (0.975, 1): 12.706205,
    (0.975, 2): 4.302653,
    (0.975, 3): 3.182446,
    (0.975, 4): 2.776445,
    (0.975, 7): 2.364624,
    (0.975, 30): 2.042272,
    (0.995, 10): 3.169273,
    (0.8, 1): 1.376382,
    (0.8, 2): 1.060660,
    (0.8, 4): 0.940965,
    (0.8, 7): 0.896030,
}


def tail_by_integration(t: float, df: int) -> float:
    """``P(|T| >= |t|)``: one minus twice the t density integrated over [0, |t|] (trapezoids on a fine grid)."""
    grid = np.linspace(0.0, abs(t), 400_001)
    log_scale = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = np.exp(log_scale - (df + 1) / 2 * np.log1p(grid**2 / df))
    inner = float(np.sum((density[1:] + density[:-1]) / 2 * np.diff(grid)))
    return 1.0 - 2.0 * inner


@pytest.mark.parametrize("probability, df", list(TABLE))
def test_t_quantiles_match_the_tables(probability, df):
    assert t_quantile(probability, df) == pytest.approx(TABLE[probability, df], abs=2e-6)
    assert t_quantile(1 - probability, df) == pytest.approx(-TABLE[probability, df], abs=2e-6)


@pytest.mark.parametrize("t, df", [(0.4, 1), (1.3, 2), (2.0, 3), (2.5, 4), (1.1, 7), (3.7, 12)])
def test_p_values_match_the_integrated_density(t, df):
    assert two_sided_p_value(t, df) == pytest.approx(tail_by_integration(t, df), abs=1e-8)
    assert two_sided_p_value(-t, df) == two_sided_p_value(t, df)


def test_a_table_quantile_leaves_five_percent_in_the_two_tails():
    for df in (2, 4, 7, 30):
        assert two_sided_p_value(TABLE[0.975, df], df) == pytest.approx(0.05, abs=1e-6)
    assert two_sided_p_value(0.0, 3) == 1.0 and two_sided_p_value(math.inf, 3) == 0.0


def test_mean_interval_is_mean_plus_minus_t_sd_over_root_n():
    values = [2.31, 2.27, 2.35]
    mean = sum(values) / 3
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 2)
    half = TABLE[0.975, 2] * sd / math.sqrt(3)
    result = mean_interval(values)
    assert result.n == 3 and result.mean == pytest.approx(mean) and result.sd == pytest.approx(sd)
    assert (result.low, result.high) == pytest.approx((mean - half, mean + half), abs=1e-6)
    assert mean_interval([1.5]) == (1, 1.5, None, None, None)
    with pytest.raises(ValueError, match="non-empty"):
        mean_interval([])


def test_paired_difference_interval_p_value_and_minimum_detectable_difference():
    baseline = np.array([2.00, 2.10, 1.95, 2.05, 2.02])
    variant = np.array([1.95, 2.02, 1.93, 1.99, 1.97])
    differences = variant - baseline
    n, mean, sd = 5, differences.mean(), differences.std(ddof=1)
    standard_error = sd / math.sqrt(n)

    result = paired_difference(variant, baseline)
    assert (result.n, result.mean, result.sd) == pytest.approx((n, mean, sd))
    half = TABLE[0.975, 4] * standard_error
    assert (result.low, result.high) == pytest.approx((mean - half, mean + half), abs=1e-6)
    assert result.p_value == pytest.approx(tail_by_integration(mean / standard_error, 4), abs=1e-8)
    assert result.p_value < 0.01  # every seed improves
    expected = (TABLE[0.975, 4] + TABLE[0.8, 4]) * standard_error
    assert result.min_detectable == pytest.approx(expected, abs=1e-6)
    assert minimum_detectable_difference(sd, n) == pytest.approx(expected, abs=1e-6)

    # Unpaired, the seed-to-seed spread of both would hide the same difference; paired it does not.
    assert result.sd < min(baseline.std(ddof=1), variant.std(ddof=1))


def test_paired_difference_of_one_seed_and_of_a_constant_shift():
    assert paired_difference([2.0], [1.5]) == (1, 0.5, None, None, None, None, None)
    same = paired_difference([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert (same.mean, same.sd, same.p_value, same.min_detectable) == (0.0, 0.0, 1.0, 0.0)
    shifted = paired_difference([1.5, 2.5, 3.5], [1.0, 2.0, 3.0])
    assert shifted.p_value == 0.0 and shifted.low == shifted.high == pytest.approx(0.5)
    with pytest.raises(ValueError, match="paired"):
        paired_difference([1.0, 2.0], [1.0])


def test_holm_steps_down_as_worked_by_hand():
    # m = 5, alpha = 0.05: 0.005 <= 0.05/5 rejected, 0.010 <= 0.05/4 rejected, 0.030 > 0.05/3: stop there.
    assert holm([0.010, 0.040, 0.030, 0.005, 0.200]) == [True, False, False, True, False]
    # 0.001 <= 0.0125, 0.013 <= 0.0167, 0.014 <= 0.025, 0.020 <= 0.05: all four (Bonferroni's 0.0125 takes one).
    assert holm([0.020, 0.001, 0.014, 0.013]) == [True, True, True, True]
    # 0.03 <= 0.05/2 fails first, so 0.04 is kept although it is below 0.05.
    assert holm([0.04, 0.03]) == [False, False]
    # Untested comparisons (None) are not in the family: m = 2.
    assert holm([None, 0.01, 0.04]) == [False, True, True]
    assert holm([0.02, 0.02], alpha=0.01) == [False, False] and holm([]) == []


def test_compare_to_baseline_pairs_common_seeds_and_corrects_over_the_grid():
    values = {
        "baseline": {0: 2.00, 1: 2.10, 2: 1.95},
        "better": {0: 1.90, 1: 2.01, 2: 1.84},
        "noisy": {0: 2.10, 1: 2.00, 2: 1.97},
        "two-seeds": {1: 2.20, 2: 2.04, 5: 9.9},  # seed 5 has no baseline partner
        "elsewhere": {7: 1.0},
    }
    result = compare_to_baseline(values, "baseline")
    assert result["baseline"] is None and result["elsewhere"] is None
    assert result["two-seeds"]["seeds"] == [1, 2] and result["two-seeds"]["n"] == 2
    assert result["two-seeds"]["mean"] == pytest.approx(((2.20 - 2.10) + (2.04 - 1.95)) / 2)
    p_values = [result[name]["p_value"] for name in ("better", "noisy", "two-seeds")]
    for name, p_value in zip(("better", "noisy", "two-seeds"), p_values, strict=True):
        differences = np.array([values[name][s] - values["baseline"][s] for s in result[name]["seeds"]])
        t = differences.mean() / (differences.std(ddof=1) / math.sqrt(len(differences)))
        assert p_value == pytest.approx(tail_by_integration(t, len(differences) - 1), abs=1e-8)
    assert [result[name]["holds"] for name in ("better", "noisy", "two-seeds")] == holm(p_values)


def test_summarize_runs_averages_figures_curves_and_layers_over_seeds():
    runs = [
        {
            "eval_loss": 2.0,
            "load_cv": 0.2,
            "max_vio": None,
            "domain_loss": {"a": 1.0, "b": 3.0},
            "eval_curve": [[100, 3.0], [200, 2.0]],
            "layers": {"load_cv": [0.1, 0.3]},
        },
        {
            "eval_loss": 2.2,
            "load_cv": 0.4,
            "domain_loss": {"a": 1.2, "b": 3.4},
            "eval_curve": [[100, 3.2], [150, 9.0], [200, 2.4]],
            "layers": {"load_cv": [0.3, 0.5]},
        },
    ]
    summary = summarize_runs(runs)
    assert summary["eval_loss"] == pytest.approx(2.1) and summary["max_vio"] is None
    assert summary["stats"]["max_vio"] is None and summary["stats"]["eval_loss"]["n"] == 2
    half = TABLE[0.975, 1] * math.sqrt(0.02) / math.sqrt(2)
    assert summary["stats"]["load_cv"]["high"] == pytest.approx(0.3 + half, abs=1e-6)
    assert summary["domain_loss"] == pytest.approx({"a": 1.1, "b": 3.2})
    assert summary["stats"]["domain_loss"]["b"]["mean"] == pytest.approx(3.2)
    assert np.allclose(summary["eval_curve"], [[100, 3.1], [200, 2.2]])  # only where both evaluated
    assert summary["layers"]["load_cv"] == pytest.approx([0.2, 0.4])

    single = summarize_runs(runs[:1])
    assert single["stats"]["eval_loss"] == {"n": 1, "mean": 2.0, "sd": None, "low": None, "high": None}
    assert summarize_runs([runs[0], {**runs[1], "layers": None}])["layers"] is None
