"""Scoring decisions (scoring.py): Scores queue until a reward worker has room; a check that
failed is retried alone, then settled by reward.on_error; a lost reward worker's checks
count as failures. Read from the Outbox, no socket."""

from __future__ import annotations

import pytest

from decisions import SECRET, Decisions, config, generated

from areal.controller.outbox import Outbox
from areal.messages import Ready, Score, Scored, WorkerError, WorkerKind
from areal.tasks.base import Verdict
from registers import register


def _generated_group(run: Decisions) -> list[str]:
    run.admit(1)
    rollout = run.join(WorkerKind.ROLLOUT)
    ids = ["g0-s0-a0", "g0-s1-a0"]
    for request_id in ids:
        run.on(rollout.identity, generated(request_id))
    return ids


def test_a_score_waits_for_a_reward_worker_and_goes_out_when_one_is_ready(tmp_path):
    run = Decisions(config(tmp_path), tmp_path)
    ids = _generated_group(run)
    assert run.core.scoring.num_queued == 2
    out = Outbox()
    run.core.dispatch(out)
    assert not out.messages  # no reward worker yet
    reward_id = b"reward-0"
    run.on(
        reward_id,
        register(WorkerKind.REWARD, "reward-0", SECRET),
    )
    (score,) = run.on(reward_id, Ready()).sent(Score)
    assert score.request_ids == ids and run.core.scoring.num_queued == 0


@pytest.mark.parametrize("on_error,kept", [("drop", False), ("zero", True)])
def test_an_infrastructure_failure_is_retried_then_settled_by_on_error(tmp_path, on_error, kept):
    run = Decisions(config(tmp_path, "reward.retries=1", f"reward.on_error={on_error}"), tmp_path)
    reward = run.join(WorkerKind.REWARD)
    ids = _generated_group(run)
    timeout = Scored(
        request_ids=ids,
        rewards=[0.0, 1.0],
        verdicts=[Verdict.TIMEOUT, Verdict.OK],
        details=["slow", ""],
        check_s=[9.0, 0.1],
    )
    (again,) = run.on(reward.identity, timeout).sent(Score)
    assert again.request_ids == ["g0-s0-a0"]  # the failed check alone, the other accepted
    out = run.on(
        reward.identity,
        Scored(
            request_ids=["g0-s0-a0"],
            rewards=[0.0],
            verdicts=[Verdict.TIMEOUT],
            details=["slow"],
            check_s=[9.0],
        ),
    )
    assert not out.sent(Score)
    assert run.core.scoring.faults.num_failures == 2
    if kept:
        (group,) = run.core.ledger.buffer
        assert [s.verdict for s in group.samples] == [Verdict.TIMEOUT, Verdict.OK]
    else:
        assert run.core.ledger.dropped_group_ids == [0] and not run.core.ledger.buffer


def test_a_failed_score_message_and_a_lost_reward_worker_count_as_failures(tmp_path):
    run = Decisions(config(tmp_path, "reward.retries=2"), tmp_path)
    first = run.join(WorkerKind.REWARD, 0)
    ids = _generated_group(run)
    out = run.on(first.identity, WorkerError(error="verifier crashed", request_ids=ids))
    # each check sent again, alone, to the least-loaded reward worker (the only one)
    assert [m.request_ids for m in out.sent(Score)] == [["g0-s0-a0"], ["g0-s1-a0"]]
    assert first.in_flight == {"g0-s0-a0", "g0-s1-a0"}
    out = Outbox()
    run.core.lose(first, "silent", out)
    assert out.restarts == [(first, "silent")]
    assert [s.num_score_failures for s in run.core.ledger.groups[0].samples] == [2, 2]
    assert run.core.scoring.num_queued == 2  # no reward worker left: queued, not lost


def test_a_scored_of_verdicts_only_accepts_each_once_and_a_stale_one_is_ignored(tmp_path):
    # Every outcome a verdict with a finite reward: each accepted in one go, counted once
    # in the step's verdict rates; an outcome for a request the worker no longer holds is
    # ignored as it is alone.
    run = Decisions(config(tmp_path), tmp_path)
    reward = run.join(WorkerKind.REWARD)
    ids = _generated_group(run)
    scored = Scored(
        request_ids=[*ids, "g9-s0-a0"],
        rewards=[1.0, 0.0, 1.0],
        verdicts=[Verdict.OK, Verdict.WRONG, Verdict.OK],
        details=["", "", ""],
        check_s=[0.1, 0.1, 0.1],
    )
    out = run.on(reward.identity, scored)
    assert not out.sent(Score)
    (group,) = run.core.ledger.buffer
    assert [s.verdict for s in group.samples] == [Verdict.OK, Verdict.WRONG]
    assert [t.reward for t in group.trajectories()] == [1.0, 0.0]
    assert run.core.scoring.faults.window_metrics() == {
        "reward/infra_failures": 0,
        "reward/retries": 0,
        "reward/infra_failure_rate": 0.0,
        "reward/verdict_rate/ok": 0.5,
        "reward/verdict_rate/wrong": 0.5,
    }
    # The step record's verdict counts hold every outcome the message carried.
    assert run.core.report._verdicts == {"ok": 2, "wrong": 1}
    assert run.on(reward.identity, scored).items == []  # the same answer again: stale
    assert len(run.core.ledger.buffer) == 1
