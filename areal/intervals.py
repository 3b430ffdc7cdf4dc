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
