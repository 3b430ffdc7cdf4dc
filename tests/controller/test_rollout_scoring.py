"""Completions scored by their rollout worker (reward.num_workers=0, scoring.py
`on_scored_completions`): a group completes on its rewards with no Score sent; an outcome
without a verdict or with a reward that is not a finite number is an infrastructure failure
settled by reward.on_error at once (the rollout worker retried it); a verdict stays a verdict;
with reward workers, a worker's own rewards are not taken. Read from the Outbox, no socket."""

from __future__ import annotations

import math
import os

import pytest

from decisions import SECRET, Decisions, config, generated

from areal.messages import Completions, Generate, Ready, Score, WorkerKind
from areal.tasks.base import Verdict
from registers import register


def _scored(request_id: str, reward: float, verdict: Verdict | None, num_tokens: int = 3):
    return generated(request_id, num_tokens, reward=reward, verdict=verdict, detail="checked")


def _run(tmp_path, *overrides: str) -> tuple[Decisions, bytes]:
    run = Decisions(config(tmp_path, "reward.num_workers=0", *overrides), tmp_path)
    run.admit(1)
    return run, run.join(WorkerKind.ROLLOUT).identity


@pytest.mark.parametrize("strict", [False, True])  # strict: each completion judged on its own
def test_a_group_completes_on_its_rollout_workers_rewards_without_a_score(tmp_path, strict):
    run, rollout = _run(tmp_path, f"staleness.strict={strict}")
    first = run.on(rollout, Completions.of([_scored("g0-s1-a0", 1.0, Verdict.OK)]))
    assert not run.core.ledger.buffer
    second = run.on(rollout, Completions.of([_scored("g0-s0-a0", 0.0, Verdict.WRONG, 4)]))
    assert not first.sent(Score) and not second.sent(Score)
    (group,) = run.core.ledger.buffer
    assert [s.verdict for s in group.samples] == [Verdict.WRONG, Verdict.OK]
    assert [t.reward for t in group.trajectories()] == [0.0, 1.0]
    assert run.core.scoring.faults.num_failures == 0


def test_the_generate_carries_the_reference_the_rollout_worker_checks_against(tmp_path):
    run = Decisions(config(tmp_path, "reward.num_workers=0"), tmp_path)
    run.admit(1)
    identity = b"rollout-0"
    run.on(identity, register(WorkerKind.ROLLOUT, "rollout-0", SECRET, pid=os.getpid()))
    (generate,) = run.on(identity, Ready(version=0)).sent(Generate)
    assert (generate.prompt_id, generate.reference) == ("p0", "1")


@pytest.mark.parametrize(
    "reward,verdict", [(1.0, None), (math.nan, Verdict.OK), (0.0, Verdict.ERROR)]
)
@pytest.mark.parametrize("on_error", ["drop", "zero"])
@pytest.mark.parametrize("strict", [False, True])
def test_a_failed_check_goes_to_on_error_at_once(tmp_path, reward, verdict, on_error, strict):
    run, rollout = _run(
        tmp_path, "reward.retries=2", f"reward.on_error={on_error}", f"staleness.strict={strict}"
    )
    completions = [_scored("g0-s0-a0", 1.0, Verdict.OK), _scored("g0-s1-a0", reward, verdict)]
    if verdict is None:  # a worker that sends no outcomes at all: each a failure
        completions = [generated("g0-s0-a0"), generated("g0-s1-a0")]
    out = run.on(rollout, Completions.of(completions))
    assert not out.sent(Score)  # never retried by the controller: no reward worker to ask
    if on_error == "drop":
        assert run.core.ledger.dropped_group_ids == [0] and not run.core.ledger.buffer
        return
    (group,) = run.core.ledger.buffer
    failed = group.samples[1]
    assert failed.verdict is Verdict.ERROR and failed.generated.reward == 0.0
    assert run.core.scoring.faults.num_failures == (2 if verdict is None else 1)


@pytest.mark.parametrize("strict", [False, True])
def test_checks_run_again_on_the_rollout_worker_count_as_failures_and_retries(tmp_path, strict):
    run, rollout = _run(tmp_path, f"staleness.strict={strict}")
    parts = [_scored("g0-s0-a0", 1.0, Verdict.OK), _scored("g0-s1-a0", 0.0, Verdict.WRONG)]
    parts[0].check_retries, parts[1].check_retries = 2, 1
    run.on(rollout, Completions.of(parts))
    assert len(run.core.ledger.buffer) == 1
    metrics = run.core.scoring.faults.window_metrics()
    assert metrics["reward/retries"] == 3 and metrics["reward/infra_failures"] == 3
    assert metrics["reward/infra_failure_rate"] == 3 / 5  # three failed of five checks run


def test_with_reward_workers_a_rollout_workers_own_rewards_are_not_taken(tmp_path):
    run = Decisions(config(tmp_path), tmp_path)
    run.admit(1)
    rollout = run.join(WorkerKind.ROLLOUT).identity
    run.on(rollout, Completions.of([_scored("g0-s0-a0", 1.0, Verdict.OK)]))
    run.on(rollout, Completions.of([_scored("g0-s1-a0", 1.0, Verdict.OK)]))
    assert not run.core.ledger.buffer
    assert run.core.scoring.num_queued == 2  # a Score waits for a reward worker
