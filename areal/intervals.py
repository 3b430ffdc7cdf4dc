"""Confidence intervals for the benchmarks' tables: of a mean over independent runs (seeds),
and of a proportion (pass@1 over held-out problems).

A learning comparison reports each number as a mean over seeds with an interval. With the
few seeds a CPU budget allows (3 to 5), a percentile bootstrap has too few distinct
resamples to be meaningful, so this is the Student t-interval: mean +- t_{(1+c)/2, n-1} *
s / sqrt(n), with s the unbiased sample standard deviation. It assumes the runs are
independent and their results roughly normal. One run gives no interval (NaN bounds).

A proportion (k of n problems solved) gets the Wilson score interval (scipy's binomtest),
which stays inside [0, 1] and keeps its coverage near 0 and 1, where pass@1 of a tiny model
often is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence

from scipy import stats


@dataclass(frozen=True)
class MeanInterval:
    mean: float
    low: float
    high: float
    n: int

    def format(self, digits: int = 3) -> str:
        """'0.812 [0.771, 0.853]', or '0.812 (n=1)' without an interval."""
        if self.n < 2:
            return f"{self.mean:.{digits}f} (n=1)"
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def t_interval(values: Sequence[float], confidence: float = 0.95) -> MeanInterval:
    """Mean of `values` and its two-sided Student t confidence interval."""
    if not values:
        raise ValueError("t_interval needs at least one value")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} must be in (0, 1)")
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return MeanInterval(mean, math.nan, math.nan, n)
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf((1 + confidence) / 2, n - 1)) * sd / math.sqrt(n)
    return MeanInterval(mean, mean - half, mean + half, n)


def proportion_interval(successes: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of `successes` out of `n` (a pass rate times n is rounded);
    (0, 1) when n is 0."""
    if n == 0:
        return 0.0, 1.0
    k = round(successes)
    if not 0 <= k <= n:
        raise ValueError(f"{successes} successes out of {n} is not a proportion")
    ci = stats.binomtest(k, n).proportion_ci(confidence, method="wilson")
    return float(ci.low), float(ci.high)


# -- paired comparisons by seed -------------------------------------------------------------
#
# Two arms run with the same seeds are compared through the per-seed differences d_i = a_i -
# b_i (same warm start, data order and sampling streams: what the arms share cancels). The
# tests below are one-sample t-tests on the d_i, which assume independent, roughly normal
# differences.


@dataclass(frozen=True)
class PairedTest:
    """A paired comparison: the mean difference a - b, its interval, and the verdict."""

    difference: MeanInterval
    """Mean of the per-seed differences and its two-sided interval (95%, or 90% for TOST)."""
    sd: float
    """Sample standard deviation of the differences (n - 1)."""
    p_value: float
    verdict: str


def paired_differences(a: Sequence[float], b: Sequence[float]) -> list[float]:
    if len(a) != len(b):
        raise ValueError(f"paired comparison of {len(a)} and {len(b)} values: pair them by seed")
    return [x - y for x, y in zip(a, b, strict=True)]


def _sd(values: Sequence[float]) -> float:
    n = len(values)
    mean = math.fsum(values) / n
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else math.nan


def paired_t_test(a: Sequence[float], b: Sequence[float], alpha: float = 0.05) -> PairedTest:
    """Two-sided test of 'a and b have the same mean', paired by position (seed)."""
    diffs = paired_differences(a, b)
    ci = t_interval(diffs, 1 - alpha)
    sd = _sd(diffs)
    if len(diffs) < 2 or sd == 0:
        return PairedTest(ci, sd, math.nan, "undecided (too few seeds)")
    t = ci.mean / (sd / math.sqrt(len(diffs)))
    p = float(2 * stats.t.sf(abs(t), len(diffs) - 1))
    verdict = (
        f"a {'>' if ci.mean > 0 else '<'} b (p = {p:.3f})"
        if p < alpha
        else f"no difference shown (p = {p:.3f})"
    )
    return PairedTest(ci, sd, p, verdict)


def tost(a: Sequence[float], b: Sequence[float], margin: float, alpha: float = 0.05) -> PairedTest:
    """Two one-sided tests of equivalence: 'a - b lies within (-margin, +margin)' is shown
    when both one-sided tests reject at `alpha`, i.e. the (1 - 2 alpha) interval of the mean
    difference lies inside the margin. p is the larger one-sided p-value."""
    if not margin > 0:
        raise ValueError(f"margin={margin!r} must be > 0")
    diffs = paired_differences(a, b)
    ci = t_interval(diffs, 1 - 2 * alpha)
    sd = _sd(diffs)
    if len(diffs) < 2 or sd == 0:
        return PairedTest(ci, sd, math.nan, "undecided (too few seeds)")
    se, dof = sd / math.sqrt(len(diffs)), len(diffs) - 1
    p = float(
        max(stats.t.sf((ci.mean + margin) / se, dof), stats.t.sf((margin - ci.mean) / se, dof))
    )
    verdict = (
        f"equivalent within +-{margin:g} (p = {p:.3f})"
        if p < alpha
        else f"equivalence within +-{margin:g} not shown (p = {p:.3f})"
    )
    return PairedTest(ci, sd, p, verdict)


def seeds_for_difference(
    sd: float, delta: float, alpha: float = 0.05, power: float = 0.8, max_seeds: int = 10_000
) -> int:
    """Seeds (pairs) a two-sided paired t-test needs to detect a true difference `delta` with
    probability `power`, for differences of standard deviation `sd`: the smallest n with
    t_{1-alpha/2, n-1} + t_{power, n-1} <= delta sqrt(n) / sd (the usual approximation)."""
    return _smallest_n(
        lambda n: (
            stats.t.ppf(1 - alpha / 2, n - 1) + stats.t.ppf(power, n - 1)
            <= delta * math.sqrt(n) / sd
        ),
        max_seeds,
    )


def seeds_for_equivalence(
    sd: float,
    margin: float,
    true_difference: float = 0.0,
    alpha: float = 0.05,
    power: float = 0.8,
    max_seeds: int = 10_000,
) -> int:
    """Seeds TOST needs to show equivalence within +-`margin` with probability `power` when
    the true difference is `true_difference` (|d| < margin): the smallest n with
    t_{1-alpha, n-1} + t_{1-beta', n-1} <= (margin - |d|) sqrt(n) / sd, beta' = (1 - power)/2
    at d = 0 (both tests must reject), (1 - power) otherwise."""
    beta = (1 - power) / 2 if true_difference == 0 else 1 - power
    room = margin - abs(true_difference)
    return _smallest_n(
        lambda n: (
            stats.t.ppf(1 - alpha, n - 1) + stats.t.ppf(1 - beta, n - 1) <= room * math.sqrt(n) / sd
        ),
        max_seeds,
    )


def detectable_difference(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true difference n paired seeds detect with probability `power`."""
    if n < 2:
        return math.inf
    return float(
        (stats.t.ppf(1 - alpha / 2, n - 1) + stats.t.ppf(power, n - 1)) * sd / math.sqrt(n)
    )


def provable_margin(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest equivalence margin n paired seeds prove with probability `power` when
    the true difference is 0."""
    if n < 2:
        return math.inf
    return float(
        (stats.t.ppf(1 - alpha, n - 1) + stats.t.ppf(1 - (1 - power) / 2, n - 1))
        * sd
        / math.sqrt(n)
    )


def _smallest_n(enough, max_seeds: int) -> int:
    for n in range(2, max_seeds + 1):
        if enough(n):
            return n
    return max_seeds
