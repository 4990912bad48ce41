"""The published-findings verdicts: paired differences over the seeds both arms ran, Holm over the claims, and the
rule that "does not reproduce" needs a comparison able to detect half the published effect."""

import numpy as np

from experiments import published_findings as findings
from experiments.published_findings import Claim, Finding

T_975 = {2: 4.302653, 4: 2.776445}  # Student's t quantiles from standard tables
T_80 = {2: 1.060660, 4: 0.940965}


def _runs(values: dict[int, float], metric: str = "eval_loss") -> dict:
    return {"runs": {str(seed): {metric: value} for seed, value in values.items()}}


def _claim(variant: str, published: float | None, direction: int = -1) -> Claim:
    return Claim(f"{variant} is lower", "eval_loss", variant, "baseline", direction, published, "made up")


FINDING = Finding("made-up", "nobody 2026", {}, ())


def test_paired_difference_interval_and_detectable_size_match_a_numpy_derivation():
    baseline = {0: 2.00, 1: 2.10, 2: 1.95, 3: 2.05, 4: 2.02}
    variant = {0: 1.90, 1: 2.02, 2: 1.84, 3: 1.97, 4: 1.90, 9: 0.0}  # seed 9 has no pair: left out
    (row,) = findings.judge([(FINDING, _claim("small", 0.5))], {"baseline": _runs(baseline), "small": _runs(variant)})
    d = np.array([variant[s] - baseline[s] for s in range(5)])
    sd = d.std(ddof=1)
    half_width = T_975[4] * sd / np.sqrt(5)
    difference = row["difference"]
    assert difference["n"] == 5
    np.testing.assert_allclose([difference["low"], difference["high"]], [d.mean() - half_width, d.mean() + half_width])
    np.testing.assert_allclose(difference["min_detectable"], (T_975[4] + T_80[4]) * sd / np.sqrt(5), rtol=1e-5)
    assert row["holds_after_holm"] and row["verdict"] == "reproduced"


def test_verdicts_follow_holm_and_the_half_effect_rule():
    base = {0: 2.0, 1: 2.1, 2: 1.9}
    arms = {
        "baseline": _runs(base),
        "opposite": _runs({s: v + 0.2 + 0.001 * s for s, v in base.items()}),  # clearly higher
        "null-sharp": _runs({s: v + 0.0005 * (-1) ** s for s, v in base.items()}),  # no effect, tiny spread
        "null-noisy": _runs({0: 2.3, 1: 1.8, 2: 2.0}),  # no effect, large spread
    }
    claims = [
        (FINDING, _claim("opposite", 0.05)),
        (FINDING, _claim("null-sharp", 0.05)),
        (FINDING, _claim("null-noisy", 0.05)),
        (FINDING, _claim("null-noisy", None)),
    ]
    rows = findings.judge(claims, arms)
    assert [row["verdict"] for row in rows] == [
        "opposite",
        "does not reproduce at this scale",  # it could have seen 0.025 and saw nothing
        "inconclusive",  # it could not have seen 0.025
        "no difference detected",  # a direction-only source
    ]
    sharp = rows[1]["difference"]
    assert sharp["min_detectable"] <= 0.025 < rows[2]["difference"]["min_detectable"]
    # Holm over the four claims: the smallest p-value is tested at alpha / 4
    assert rows[0]["difference"]["p_value"] < 0.05 / 4
    table = findings.findings_table({"claims": rows})
    assert table.count("\n| made-up |") == 4 and "does not reproduce at this scale" in table


def test_every_finding_names_arms_it_defines():
    for finding in findings.FINDINGS:
        for claim in finding.claims:
            for arm in (claim.variant, claim.reference):
                assert arm == "baseline" or arm in finding.variants, (finding.name, arm)
    assert {f.name for f in findings.FINDINGS} == set(findings.FindingName.__args__)
