"""A reward that could not be computed is not a wrong answer (reward.retries, reward.on_error).

Unit tests of the policy (controller/reward_faults.py), then a real run whose verifier fails
half of its checks (letter_task.py, flaky=0.5): failed checks are retried, samples out of
retries get their group dropped (reason reward_error) and replaced, no trained sample carries
an infrastructure verdict, and the step records show the failure and verdict rates.
"""

from __future__ import annotations

import asyncio

import pytest

from areal.config import ConfigError, RewardConfig, load_config
from areal.controller.reward_faults import Action, RewardFaults
from areal.tasks.base import Verdict
from cli_runs import letter_overrides
from letter_runs import letter_task_importable, recorded_run

STEPS = 4


def test_failures_are_retried_then_dropped_by_default():
    faults = RewardFaults(RewardConfig(retries=2))
    assert faults.judge(Verdict.ERROR, 1, training=True) is Action.RETRY
    assert faults.judge(Verdict.TIMEOUT, 2, training=True) is Action.RETRY
    assert faults.judge(None, 3, training=True) is Action.DROP  # a lost worker counts too
    assert faults.judge(Verdict.WRONG, 0, training=True) is Action.ACCEPT
    metrics = faults.window_metrics()
    assert metrics["reward/infra_failures"] == 3 and metrics["reward/retries"] == 2
    assert metrics["reward/infra_failure_rate"] == 0.75
    assert metrics["reward/verdict_rate/wrong"] == 1.0
    assert faults.window_metrics()["reward/infra_failures"] == 0  # a new window


def test_verdicts_are_never_retried():
    faults = RewardFaults(RewardConfig(retries=5))
    for verdict in (Verdict.OK, Verdict.WRONG, Verdict.NO_ANSWER):
        assert faults.judge(verdict, 0, training=True) is Action.ACCEPT
    assert faults.num_failures == 0


def test_zero_scores_a_sample_out_of_retries_and_evaluation_is_never_dropped():
    zero = RewardFaults(RewardConfig(retries=0, on_error="zero"))
    assert zero.judge(Verdict.MEMORY, 1, training=True) is Action.ACCEPT
    assert zero.window_metrics()["reward/verdict_rate/memory"] == 1.0
    drop = RewardFaults(RewardConfig(retries=0))
    assert drop.judge(Verdict.ERROR, 1, training=False) is Action.ACCEPT


def test_an_episode_failure_is_not_retried():
    """An episode's reward came from its environment: no reward worker can score it again."""
    faults = RewardFaults(RewardConfig(retries=2))
    assert faults.judge(Verdict.ERROR, 1, training=True, retryable=False) is Action.DROP
    assert faults.judge(Verdict.OK, 0, training=True, retryable=False) is Action.ACCEPT
    zero = RewardFaults(RewardConfig(retries=2, on_error="zero"))
    assert zero.judge(Verdict.TIMEOUT, 1, training=True, retryable=False) is Action.ACCEPT


def test_the_options_are_checked_and_named():
    with pytest.raises(ConfigError, match="reward.retries=-1 must be >= 0"):
        load_config(overrides=["reward.retries=-1"])
    with pytest.raises(ConfigError, match="reward.on_error='skip' is not one of drop, zero"):
        load_config(overrides=["reward.on_error=skip"])


@pytest.mark.slow
def test_a_flaky_verifier_gives_no_false_zeros(tmp_path, tiny_model_dir):
    cfg = load_config(
        overrides=letter_overrides(
            tmp_path / "run",
            tiny_model_dir,
            f"trainer.total_steps={STEPS}",
            "trainer.checkpoint_every=0",
            "task.params.flaky=0.5",
            "reward.retries=1",
        )
    )
    with letter_task_importable():
        run = asyncio.run(recorded_run(cfg))
    ctl, steps = run["ctl"], [r for r in run["records"] if r["kind"] == "step"]
    assert run["summary"]["steps"] == STEPS
    trained = ctl.ledger.trained_group_ids
    assert trained and all(not v.is_error() for g in trained for v in run["completed"][g])
    dropped = sum(r.get("rollout/dropped_groups/reward_error", 0) for r in steps)
    assert dropped > 0 and run["summary"]["dropped_groups"]["reward_error"] >= dropped
    assert sum(r["reward/retries"] for r in steps) > 0
    assert sum(r["reward/infra_failures"] for r in steps) > 0
    # A step's window may hold only failed checks (rate 1: a few checks at a 50% failure
    # rate); some window held a success, and a rate is above 0 exactly when failures are.
    rates = [r["reward/infra_failure_rate"] for r in steps]
    assert all(0 <= rate <= 1 for rate in rates) and min(rates) < 1
    assert all(
        (r["reward/infra_failure_rate"] > 0) == (r["reward/infra_failures"] > 0) for r in steps
    )
    # The rates of a step's window sum to 1; a window in which no check ended (its batch was
    # scored before the previous record was written) has none.
    sums = [sum(v for k, v in r.items() if k.startswith("reward/verdict_rate/")) for r in steps]
    assert all(abs(total - 1) < 1e-9 or total == 0 for total in sums) and max(sums) > 0
    assert ctl.core.scoring.faults.num_failures > 0
