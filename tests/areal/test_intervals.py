"""Student t-intervals over seeds: hand-computed values, the degenerate cases, bad input."""

from __future__ import annotations

import math

import pytest

from scipy import stats

from areal.intervals import (
    detectable_difference,
    paired_t_test,
    proportion_interval,
    provable_margin,
    seeds_for_difference,
    seeds_for_equivalence,
    t_interval,
    tost,
)


def test_three_seeds_hand_computed():
    # mean 0.5, s = 0.1, t_{0.975, 2} = 4.30265273 (t tables give 4.303)
    out = t_interval([0.4, 0.5, 0.6])
    half = 4.30265273 * 0.1 / math.sqrt(3)
    assert out.mean == pytest.approx(0.5, abs=1e-15) and out.n == 3
    assert out.low == pytest.approx(0.5 - half, abs=1e-8)
    assert out.high == pytest.approx(0.5 + half, abs=1e-8)
    assert out.format() == f"0.500 [{0.5 - half:.3f}, {0.5 + half:.3f}]"


def test_wider_with_more_confidence_narrower_with_more_seeds():
    values = [0.71, 0.75, 0.69, 0.8, 0.77]
    assert t_interval(values, 0.99).high > t_interval(values, 0.95).high
    assert (
        t_interval(values * 2).high - t_interval(values * 2).low
        < t_interval(values).high - t_interval(values).low
    )


def test_equal_values_give_a_zero_width_interval_and_one_value_none():
    out = t_interval([0.9, 0.9, 0.9])
    assert out.low == out.mean == out.high == pytest.approx(0.9)
    single = t_interval([0.3])
    assert single.mean == 0.3 and math.isnan(single.low) and single.format() == "0.300 (n=1)"


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="at least one value"):
        t_interval([])
    with pytest.raises(ValueError, match="confidence=1.5"):
        t_interval([1.0, 2.0], 1.5)


def test_wilson_interval_hand_computed():
    # Wilson (1927): centre (p + z^2/2n) / (1 + z^2/n), half-width
    # z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n); 3 of 10, z = 1.959964: [0.1078, 0.6032].
    low, high = proportion_interval(3, 10)
    assert low == pytest.approx(0.10779, abs=1e-4) and high == pytest.approx(0.60322, abs=1e-4)
    low, high = proportion_interval(0, 10)  # stays inside [0, 1] at the edge
    assert low == 0.0 and high == pytest.approx(0.27753, abs=1e-4)
    assert proportion_interval(0.75 * 8, 8) == proportion_interval(6, 8)  # a rate times n
    assert proportion_interval(0, 0) == (0.0, 1.0)


def test_a_count_outside_zero_to_n_is_refused():
    with pytest.raises(ValueError, match="11 successes out of 10"):
        proportion_interval(11, 10)


def test_paired_t_test_is_scipys_on_the_differences():
    a, b = [0.61, 0.55, 0.70, 0.64, 0.59], [0.52, 0.50, 0.66, 0.55, 0.57]
    test = paired_t_test(a, b)
    reference = stats.ttest_rel(a, b)
    assert test.p_value == pytest.approx(reference.pvalue, rel=1e-9)
    assert test.difference.mean == pytest.approx(0.058) and test.verdict.startswith("a > b")
    ci = reference.confidence_interval(0.95)
    assert (test.difference.low, test.difference.high) == pytest.approx((ci.low, ci.high))
    assert "no difference" in paired_t_test([0.5, 0.6, 0.4], [0.55, 0.5, 0.45]).verdict
    with pytest.raises(ValueError, match="pair them by seed"):
        paired_t_test([1.0, 2.0], [1.0])


def test_tost_shows_equivalence_exactly_when_the_90_interval_is_inside_the_margin():
    a = [0.50, 0.52, 0.49, 0.51, 0.50, 0.51]
    b = [0.50, 0.50, 0.50, 0.50, 0.51, 0.50]
    test = tost(a, b, margin=0.03)
    assert test.verdict.startswith("equivalent") and test.p_value < 0.05
    assert test.difference.low > -0.03 and test.difference.high < 0.03  # 90% interval
    # The larger of the two one-sided p-values (scipy's one-sided paired tests).
    shifted_up = stats.ttest_rel([x + 0.03 for x in a], b, alternative="greater").pvalue
    shifted_down = stats.ttest_rel([x - 0.03 for x in a], b, alternative="less").pvalue
    assert test.p_value == pytest.approx(max(shifted_up, shifted_down), rel=1e-9)
    wide = tost([0.4, 0.6, 0.5, 0.7], [0.5, 0.5, 0.5, 0.5], margin=0.03)
    assert "not shown" in wide.verdict and wide.p_value > 0.05


def test_power_calculations_agree_with_the_textbook_normal_approximation():
    # n ~ ((z_{1-a/2} + z_{power}) sd / delta)^2 = (2.80 * 0.1 / 0.05)^2 = 31.4; the t
    # quantiles add a few seeds.
    n = seeds_for_difference(sd=0.1, delta=0.05)
    assert 32 <= n <= 35
    assert detectable_difference(0.1, n) <= 0.05 < detectable_difference(0.1, n - 1)
    m = seeds_for_equivalence(sd=0.05, margin=0.03)
    assert provable_margin(0.05, m) <= 0.03 < provable_margin(0.05, m - 1)
    assert seeds_for_equivalence(sd=0.05, margin=0.03, true_difference=0.01) > m
    assert detectable_difference(0.1, 1) == math.inf
