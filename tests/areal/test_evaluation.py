"""pass@k: the unbiased estimator against hand-computed closed forms and against brute-force
enumeration of every k-subset of the samples; `summarize` on a hand-computed case."""

from __future__ import annotations

import itertools
import math

import pytest

from areal.evaluation import pass_at_k, summarize
from areal.tasks.base import Verdict

OK, WRONG, TIMEOUT, NO_ANSWER = Verdict.OK, Verdict.WRONG, Verdict.TIMEOUT, Verdict.NO_ANSWER


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (1, 0, 1, 0.0),
        (1, 1, 1, 1.0),
        (5, 2, 1, 2 / 5),  # pass@1 is the fraction correct
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (5, 2, 4, 1.0),  # n - c < k: some sample must be correct
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (16, 1, 8, 0.5),  # one correct sample, half of them drawn
        (100, 0, 10, 0.0),
        (4, 4, 4, 1.0),
    ],
)
def test_pass_at_k_matches_hand_computed_closed_forms(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def _enumerated(n: int, c: int, k: int) -> float:
    """Naive reference: the share of all k-subsets of n samples holding a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_brute_force_enumeration_for_every_small_case():
    diffs = []
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert _enumerated(n, c, k) == pytest.approx(exact, abs=1e-12)
                diffs.append(abs(pass_at_k(n, c, k) - exact))
    assert max(diffs) < 1e-12, f"max diff {max(diffs):.2e}, mean {sum(diffs) / len(diffs):.2e}"


def test_pass_at_k_grows_with_k_and_with_correct_samples():
    for c in range(9):
        values = [pass_at_k(8, c, k) for k in range(1, 9)]
        assert values == sorted(values)
    assert [pass_at_k(8, c, 3) for c in range(9)] == sorted(pass_at_k(8, c, 3) for c in range(9))


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="num_correct=4 outside"):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="k=4 outside"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="k=0 outside"):
        pass_at_k(3, 1, 0)


def test_summarize_averages_over_problems_and_counts_unjudged_samples():
    verdicts = [[OK, WRONG, WRONG, OK], [WRONG, TIMEOUT, NO_ANSWER, WRONG]]
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    out = summarize(verdicts, rewards)
    assert out["eval/num_problems"] == 2 and out["eval/num_samples"] == 4
    assert out["eval/pass@1"] == pytest.approx((2 / 4 + 0) / 2)
    assert out["eval/pass@2"] == pytest.approx((1 - 1 / 6 + 0) / 2)  # 1 - C(2,2)/C(4,2)
    assert out["eval/pass@4"] == pytest.approx(0.5)
    assert "eval/pass@3" not in out  # powers of two only; areal.eval adds others on request
    assert out["eval/reward_mean"] == pytest.approx(2 / 8)
    assert out["eval/unjudged_fraction"] == pytest.approx(1 / 8)
