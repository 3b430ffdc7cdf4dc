"""Held-out evaluation metrics: pass@k with the unbiased estimator, and their aggregation.

pass@k for one problem with n samples of which c are correct is the probability that at
least one of k samples drawn without replacement is correct: 1 - C(n-c, k) / C(n, k)
(Chen et al., 2021). Averaged over problems. A sample counts as correct when its verdict is
OK. This module computes; running the samples is the controller's or `areal.eval`'s job.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from areal.tasks.base import Verdict


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one problem (n = num_samples, c = num_correct)."""
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"num_correct={num_correct} outside [0, num_samples={num_samples}]")
    if not 1 <= k <= num_samples:
        raise ValueError(f"k={k} outside [1, num_samples={num_samples}]")
    if num_samples - num_correct < k:
        return 1.0
    # 1 - prod_{i=n-c+1}^{n} (1 - k/i): numerically stable form of the binomial ratio.
    return 1.0 - math.prod(
        1.0 - k / i for i in range(num_samples - num_correct + 1, num_samples + 1)
    )


def summarize(
    verdicts_per_problem: Sequence[Sequence[Verdict]],
    rewards_per_problem: Sequence[Sequence[float]],
) -> dict[str, float]:
    """eval/ metrics over problems: pass@k for k = 1, 2, 4, ... up to the sample count,
    mean reward, and the fraction of samples the checker could not judge."""
    if not verdicts_per_problem:
        raise ValueError("no problems to summarize")
    num_samples = min(len(v) for v in verdicts_per_problem)
    out: dict[str, float] = {
        "eval/num_problems": float(len(verdicts_per_problem)),
        "eval/num_samples": float(num_samples),
    }
    k = 1
    while k <= num_samples:
        scores = [
            pass_at_k(len(v), sum(x is Verdict.OK for x in v), k) for v in verdicts_per_problem
        ]
        out[f"eval/pass@{k}"] = sum(scores) / len(scores)
        k *= 2
    flat_rewards = [r for rs in rewards_per_problem for r in rs]
    flat_verdicts = [v for vs in verdicts_per_problem for v in vs]
    out["eval/reward_mean"] = sum(flat_rewards) / len(flat_rewards)
    out["eval/unjudged_fraction"] = sum(v.is_error() for v in flat_verdicts) / len(flat_verdicts)
    return out
