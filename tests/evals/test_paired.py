"""Paired comparisons checked against direct computations: McNemar's exact p on a hand-built
table, the paired t by its formula, bootstrap intervals against a plain resampling loop, and
Benjamini-Hochberg by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from evals.paired import (
    Z_MDE,
    accuracy_difference,
    adjust,
    bits_per_byte_difference,
    verdict,
    window_difference,
)


def _table(both: int, only_ref: int, only_var: int, neither: int) -> tuple[list[int], list[int]]:
    ref = [1] * both + [1] * only_ref + [0] * only_var + [0] * neither
    var = [1] * both + [0] * only_ref + [1] * only_var + [0] * neither
    return ref, var


def test_mcnemar_exact_p_of_a_hand_built_table() -> None:
    ref, var = _table(both=50, only_ref=10, only_var=2, neither=38)
    result = accuracy_difference(ref, var)
    # two-sided exact: 2 * P(X <= 2), X ~ Binomial(12, 1/2)
    assert result.p == pytest.approx(2 * (1 + 12 + 66) / 2**12)
    assert result.n == 100 and result.delta == pytest.approx(-0.08)
    assert result.low < -0.08 < result.high < 0
    # the concordant documents do not move the p-value, only the discordant ones
    ref2, var2 = _table(both=5, only_ref=10, only_var=2, neither=3)
    assert accuracy_difference(ref2, var2).p == pytest.approx(result.p)


def test_accuracy_interval_matches_a_plain_paired_bootstrap() -> None:
    rng = np.random.default_rng(7)
    ref = (rng.random(200) < 0.6).astype(float)
    var = ref.copy()
    flip = rng.random(200) < 0.2
    var[flip] = 1 - var[flip]
    result = accuracy_difference(ref, var)
    diffs = var - ref
    means = [diffs[rng.integers(0, 200, 200)].mean() for _ in range(20_000)]
    assert result.low == pytest.approx(np.percentile(means, 2.5), abs=0.006)
    assert result.high == pytest.approx(np.percentile(means, 97.5), abs=0.006)
    assert result.mde == pytest.approx(Z_MDE * diffs.std(ddof=1) / math.sqrt(200), rel=0.1)
    assert accuracy_difference(ref, var).low == result.low  # seeded: the same interval again


def test_identical_scores_have_no_difference_and_a_floor_on_what_n_detects() -> None:
    ref, var = _table(both=60, only_ref=0, only_var=0, neither=40)
    result = accuracy_difference(ref, var)
    assert (result.delta, result.low, result.high, result.p) == (0.0, 0.0, 0.0, 1.0)
    assert result.mde == pytest.approx(6 / 100)  # 6 discordant documents, all one way, at least


def test_window_difference_is_the_paired_t() -> None:
    ref = [3.1, 3.2, 3.0, 3.3, 3.1, 3.2, 3.4, 3.0]
    var = [3.15, 3.22, 3.05, 3.31, 3.16, 3.25, 3.41, 3.07]
    result = window_difference(ref, var)
    d = np.subtract(var, ref)
    se = d.std(ddof=1) / math.sqrt(8)
    t = d.mean() / se
    assert result.delta == pytest.approx(d.mean())
    assert result.p == pytest.approx(2 * stats.t.sf(abs(t), 7))
    half = stats.t.ppf(0.975, 7) * se
    assert (result.low, result.high) == pytest.approx((d.mean() - half, d.mean() + half))
    assert result.mde == pytest.approx((stats.t.ppf(0.975, 7) + stats.t.ppf(0.8, 7)) * se)
    # unpaired, the same two samples are far from significant
    assert stats.ttest_ind(var, ref).pvalue > 0.5 > 0.01 > result.p


def test_bits_per_byte_difference_is_the_ratio_of_sums() -> None:
    rng = np.random.default_rng(3)
    size = rng.integers(200, 400, 30)
    ref = -rng.random(30) * 2 * size
    var = ref - rng.random(30) * 5
    result = bits_per_byte_difference(ref, var, size)
    expected = (ref.sum() - var.sum()) / size.sum() / math.log(2)
    assert result.delta == pytest.approx(expected) and result.delta > 0
    assert result.low < expected < result.high and result.p < 0.01
    same = bits_per_byte_difference(ref, ref, size)
    assert (same.delta, same.p) == (0.0, 1.0)
    with pytest.raises(ValueError, match="29 byte counts for 30 documents"):
        bits_per_byte_difference(ref, var, size[:29])


def test_benjamini_hochberg_by_hand() -> None:
    # sorted 0.01, 0.03, 0.04, 0.5 -> x 4/rank: 0.04, 0.06, 0.0533, 0.5 -> running minimum from the top
    assert adjust([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.16 / 3, 0.16 / 3, 0.5])
    assert adjust([]) == []


def test_verdict_follows_the_metrics_direction() -> None:
    assert verdict(0.02, 0.01, "higher") == "better"
    assert verdict(0.02, 0.01, "lower") == "worse"
    assert verdict(-0.02, 0.2, "higher") == "no detectable difference"


def test_unpaired_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="two equal, non-empty lists"):
        accuracy_difference([1, 0, 1], [1, 0])
    with pytest.raises(ValueError, match="two equal, non-empty lists"):
        window_difference([], [])
