"""The controller's decision on each message (core.py), read from the Outbox it returns:
no channel, no worker process. The real-process runs that exercise the same decisions end to
end are test_runtime.py, test_hostile_peers.py and their neighbours."""

from __future__ import annotations

import asyncio
import math
import os

import numpy as np
import pytest

from decisions import SECRET, Decisions, config, generated

from areal.controller import checks
from areal.controller.ledger import Purpose, Stage
from areal.controller.outbox import Outbox
from areal.messages import (
    Cancel,
    Completions,
    Generate,
    Ready,
    Score,
    Scored,
    Shutdown,
    Train,
    Trained,
    UpdateWeights,
    Welcome,
    WeightsChunk,
    WorkerError,
    WorkerKind,
)
from areal.tasks.base import Verdict
from registers import register


@pytest.fixture
def run(tmp_path):
    return Decisions(config(tmp_path), tmp_path)


def _request_ids(out) -> list[str]:
    return [request_id for m in out.sent(Generate) for request_id in m.request_ids]


def test_a_worker_with_the_secret_is_welcomed_and_a_stranger_is_sent_away(run):
    out = run.on(
        b"r0",
        register(WorkerKind.ROLLOUT, "rollout-0", SECRET, pid=os.getpid()),
    )
    (welcome,) = out.sent()
    assert isinstance(welcome, Welcome) and welcome.version == 0
    assert welcome.config == {"run": "test"} and welcome.weights_path is None
    out = run.on(
        b"x",
        register(WorkerKind.ROLLOUT, "intruder", "wrong"),
    )
    (refusal,) = out.sent()
    assert isinstance(refusal, Shutdown) and refusal.reason == "registration refused: wrong secret"
    assert run.pool.refused == ["intruder"]
    assert run.core.peer_log.totals["registration refused"] == 1


def test_samples_are_dispatched_as_a_worker_becomes_ready_in_the_same_decision(run):
    run.admit(1)
    identity = b"rollout-0"
    run.on(
        identity,
        register(WorkerKind.ROLLOUT, "rollout-0", SECRET),
    )
    out = run.on(identity, Ready(version=0))
    (generate,) = out.sent(Generate)  # the group in one message
    assert generate.request_ids == ["g0-s0-a0", "g0-s1-a0"]
    assert all(dest == identity for dest, _ in out.messages)
    assert generate.max_new_tokens == 8 and generate.stop_token_ids == [0]
    assert generate.temperature == run.cfg.rollout.temperature


def test_the_last_sample_of_a_group_sends_the_whole_group_to_one_reward_worker(run):
    run.admit(1)
    rollout = run.join(WorkerKind.ROLLOUT)
    reward = run.join(WorkerKind.REWARD)
    assert not run.on(rollout.identity, generated("g0-s0-a0")).sent(Score)
    (score,) = run.on(rollout.identity, generated("g0-s1-a0")).sent(Score)
    assert score.request_ids == ["g0-s0-a0", "g0-s1-a0"] and score.reference == "1"
    assert reward.in_flight == {"g0-s0-a0", "g0-s1-a0"}
    assert run.core.admission.staleness.num_buffered == 2


def test_a_groups_completions_in_one_message_send_the_group_for_scoring(run):
    run.admit(1)
    rollout = run.join(WorkerKind.ROLLOUT)
    reward = run.join(WorkerKind.REWARD)
    answer = Completions.of([generated("g0-s1-a0", 2), generated("g0-s0-a0", 4)])
    answer.num_interruptions = [1, 2]
    run.core.report.start_training()
    (score,) = run.on(rollout.identity, answer).sent(Score)
    assert run.core.report._generated_tokens == 6 and run.core.report.num_interruptions == 3
    assert sorted(score.request_ids) == ["g0-s0-a0", "g0-s1-a0"]
    assert not rollout.in_flight and reward.in_flight == {"g0-s0-a0", "g0-s1-a0"}
    lengths = {s.request_id: len(s.generated.output_ids) for s in run.core.ledger.groups[0].samples}
    assert lengths == {"g0-s0-a0": 4, "g0-s1-a0": 2}


def test_a_stale_completion_in_a_completions_counts_for_nothing(run):
    # Recorded a message at a time: throughput, interruptions and the staleness count take
    # only the completions the ledger accepted, as one Generated each would.
    run.admit(1)
    rollout = run.join(WorkerKind.ROLLOUT)
    fresh, stale = generated("g0-s0-a0", 3), generated("g9-s0-a0", 5)
    fresh.num_interruptions, stale.num_interruptions = 1, 4
    run.core.report.start_training()
    run.on(rollout.identity, Completions.of([fresh, stale]))
    assert run.core.report.num_interruptions == 1
    assert run.core.report._generated_tokens == 3
    assert run.core.admission.staleness.num_buffered == 1


def test_completions_whose_parts_do_not_fit_are_refused_whole_and_generated_again(run):
    run.admit(1)
    rollout = run.join(WorkerKind.ROLLOUT)
    answer = Completions.of([generated("g0-s0-a0", 2), generated("g0-s1-a0", 4)])
    answer.lengths = [2, 3]  # one token short of the arrays
    out = run.on(rollout.identity, answer)
    assert not out.sent(Score)
    assert run.core.peer_log.totals["contradicts the ledger"] == 1
    assert sorted(_request_ids(out)) == ["g0-s0-a1", "g0-s1-a1"]  # both again, in one message


def test_completions_the_intake_checked_are_not_checked_again_and_a_misfit_is_worded_here(
    run, monkeypatch
):
    run.admit(2)
    rollout = run.join(WorkerKind.ROLLOUT)
    run.join(WorkerKind.REWARD)
    reported = []
    report = run.core.peer_log.report
    monkeypatch.setattr(
        run.core.peer_log,
        "report",
        lambda peer, reason, detail, **fields: (
            reported.append(detail) or report(peer, reason, detail, **fields)
        ),
    )
    misfit = Completions.of([generated("g0-s0-a0", 2), generated("g0-s1-a0", 4)])
    misfit.lengths = [2, 3]  # one token short of the arrays
    checks.read_completions(misfit)  # the intake's work, before the loop takes the message
    assert misfit.parts_fit is False and misfit.token_bounds is None
    out = run.on(rollout.identity, misfit)
    assert sorted(_request_ids(out)) == ["g0-s0-a1", "g0-s1-a1"]  # refused whole
    (detail,) = reported
    assert "lengths [2, 3] (sum 5) do not cut arrays" in detail  # the check's own words
    fits = Completions.of([generated("g1-s0-a0", 2), generated("g1-s1-a0", 4)])
    checks.read_completions(fits)
    assert fits.parts_fit is True and fits.token_bounds is not None

    def checked_again(self):
        raise AssertionError("checked on the loop after the intake")

    monkeypatch.setattr(Completions, "check", checked_again)
    (score,) = run.on(rollout.identity, fits).sent(Score)
    assert sorted(score.request_ids) == ["g1-s0-a0", "g1-s1-a0"]


def test_a_completion_that_contradicts_the_ledger_is_refused_and_generated_again(run):
    run.admit(1)
    rollout = run.join(WorkerKind.ROLLOUT)
    out = run.on(rollout.identity, generated("g0-s0-a0", version=3))  # a version not published
    assert not out.sent(Score)
    assert run.core.peer_log.totals["contradicts the ledger"] == 1
    # re-queued under a new attempt id, and dispatched again in the same decision
    assert _request_ids(out) == ["g0-s0-a1"]
    assert run.core.ledger.by_request["g0-s0-a1"].stage is Stage.GENERATING


def test_scored_groups_go_to_the_buffer_and_a_non_finite_reward_is_scored_again(run):
    run.admit(1)
    rollout, reward = run.join(WorkerKind.ROLLOUT), run.join(WorkerKind.REWARD)
    run.on(rollout.identity, generated("g0-s0-a0"))
    run.on(rollout.identity, generated("g0-s1-a0"))
    out = run.on(
        reward.identity,
        Scored(
            request_ids=["g0-s0-a0", "g0-s1-a0"],
            rewards=[1.0, math.nan],
            verdicts=[Verdict.OK] * 2,
            details=["", ""],
            check_s=[0.0, 0.0],
        ),
    )
    (again,) = out.sent(Score)
    assert again.request_ids == ["g0-s1-a0"]  # alone, on the least-loaded reward worker
    assert not run.core.ledger.buffer
    run.on(
        reward.identity,
        Scored(
            request_ids=["g0-s1-a0"],
            rewards=[0.0],
            verdicts=[Verdict.WRONG],
            details=[""],
            check_s=[0.0],
        ),
    )
    (group,) = run.core.ledger.buffer
    assert [t.reward for t in group.trajectories()] == [1.0, 0.0]


def test_rank_0_s_trained_publishes_the_version_before_the_step_is_handed_back(run):
    rollouts = [run.join(WorkerKind.ROLLOUT, i) for i in range(2)]
    trainer = run.join(WorkerKind.TRAINER)
    answer = Trained(step=1, version=1, stats={}, weights_path="/w/v1")
    out = run.on(trainer.identity, answer)
    assert run.core.peer_log.totals["unexpected message"] == 1  # no step is out: refused
    assert not out.sent(UpdateWeights) and run.core.weights.version == 0

    async def step_out_and_answered():
        run.core.trainers.formed = True
        step = asyncio.create_task(run.core.trainers.run_step(1, [_train()], lambda: False))
        await asyncio.sleep(0)  # Train sent (through the shell's send: recorded)
        out = run.on(trainer.identity, answer)
        assert not step.done()
        for item in out.items:  # as the shell carries the outbox out
            if type(item) is not tuple:
                item()
        return out, await step

    out, trained = asyncio.run(step_out_and_answered())
    # UpdateWeights to each rollout worker, then the wake-ups (loops notified, the step
    # handed to the train driver), in that order
    updates = [(dest, msg) for dest, msg in out.messages if isinstance(msg, UpdateWeights)]
    assert [dest for dest, _ in updates] == [h.identity for h in rollouts]
    assert all(m.version == 1 and m.path == "/w/v1" and m.mode == "disk" for _, m in updates)
    assert ["send" if type(item) is tuple else "wake" for item in out.items] == [
        "send",
        "send",
        "wake",
        "wake",
    ]
    assert trained is answer and run.core.weights.version == 1
    assert run.core.weights.latest == "/w/v1"


def _train() -> Train:
    n = np.zeros(2, np.int32)
    return Train(
        step=1,
        version=0,
        token_ids=n,
        logprobs=n.astype(np.float32),
        versions=n,
        loss_mask=n.astype(bool),
        cu_seqlens=np.array([0, 2], np.int32),
        rewards=np.zeros(1, np.float32),
        group_ids=np.zeros(1, np.int64),
    )


def test_a_weights_chunk_outside_stream_mode_is_refused(run):
    trainer = run.join(WorkerKind.TRAINER)
    out = run.on(
        trainer.identity, WeightsChunk(version=1, index=0, num_chunks=1, names=[], tensors=[])
    )
    assert not out.messages and run.core.peer_log.totals["unexpected message"] == 1


def test_a_message_from_the_wrong_kind_of_worker_is_refused_and_changes_nothing(run):
    run.admit(1)
    rollout = run.join(WorkerKind.ROLLOUT)
    out = run.on(
        rollout.identity,
        Scored(
            request_ids=["g0-s0-a0"],
            rewards=[1.0],
            verdicts=[Verdict.OK],
            details=[""],
            check_s=[0.0],
        ),
    )
    assert not out.messages
    assert run.core.peer_log.totals["unexpected message"] == 1
    assert run.core.ledger.by_request["g0-s0-a0"].stage is Stage.GENERATING


def test_a_worker_s_fatal_error_re_queues_its_work_and_asks_for_its_restart(run):
    run.admit(1)
    rollout = run.join(WorkerKind.ROLLOUT)
    out = run.on(rollout.identity, WorkerError(error="engine died", fatal=True))
    assert out.restarts == [(rollout, "fatal error: engine died")]
    assert rollout.identity is None and not rollout.ready  # forgotten by the pool
    assert sorted(s.request_id for s in run.core.ledger.pending) == ["g0-s0-a1", "g0-s1-a1"]
    assert run.core.losing == {"rollout-0"}
    run.core.restarted(rollout)
    assert not run.core.losing


def test_a_trainer_rank_stopped_by_its_group_s_restart_is_not_lost_again(run):
    """Rank 1 died; restarting the group kills rank 0, whose exited process the liveness loop
    may find before it is started again: the restart's doing, not a second loss."""
    trainer = run.join(WorkerKind.TRAINER)
    run.core.trainers.restarting.add(trainer.worker_id)
    out = Outbox()
    run.core.lose(trainer, "process exited", out)
    assert not out.restarts and not run.core.losing
    assert run.pool.get(trainer.identity) is trainer  # not forgotten
    run.core.trainers.restarting.clear()  # the restart is over: a loss again
    run.core.lose(trainer, "process exited", out)
    assert out.restarts == [(trainer, "process exited")]


def test_dropping_a_group_cancels_its_generations_and_frees_its_slots(run):
    run.admit(2)
    rollout = run.join(WorkerKind.ROLLOUT)
    group = run.core.ledger.groups[0]
    live = run.core.admission.staleness.num_live
    out = Outbox()
    run.core.drop_group(group, "by_test", out)
    (cancel,) = out.sent(Cancel)
    assert cancel.request_ids == ["g0-s0-a0", "g0-s1-a0"]
    assert rollout.in_flight == {"g1-s0-a0", "g1-s1-a0"}
    assert run.core.admission.staleness.num_live == live - 2
    assert run.core.ledger.dropped_group_ids == [0]
    assert out.items[-1] == run.changed.notify  # admission may replace it


def test_an_evaluation_round_is_done_when_its_last_group_is_scored(run):
    rollout, reward = run.join(WorkerKind.ROLLOUT), run.join(WorkerKind.REWARD)
    round_ = run.core.evaluations.start(version=0)
    out = Outbox()
    run.core.dispatch(out)
    request_ids = _request_ids(out)
    assert len(request_ids) == run.cfg.eval.num_samples
    assert run.core.ledger.groups[0].purpose is Purpose.EVAL
    for request_id in request_ids:
        run.on(rollout.identity, generated(request_id))
    out = run.on(
        reward.identity,
        Scored(
            request_ids=request_ids,
            rewards=[1.0] * len(request_ids),
            verdicts=[Verdict.OK] * len(request_ids),
            details=[""] * len(request_ids),
            check_s=[0.0] * len(request_ids),
        ),
    )
    assert not round_.done.is_set()
    wake = [item for item in out.items if type(item) is not tuple]
    assert wake == [round_.done.set]


def test_heartbeats_go_only_to_workers_sent_nothing_else_since_the_last_round(run):
    for name in (b"rollout-0", b"rollout-1"):
        run.on(
            name,
            register(WorkerKind.ROLLOUT, name.decode(), SECRET),
        )
    assert run.core.heartbeat_targets() == [b"rollout-0", b"rollout-1"]
    assert run.core.heartbeat_targets({b"rollout-0"}) == [b"rollout-1"]


def test_a_heartbeat_notes_a_registered_worker_alive_and_a_stranger_s_is_left_to_be_refused(
    run,
):
    run.on(
        b"rollout-0",
        register(WorkerKind.ROLLOUT, "rollout-0", SECRET),
    )
    assert run.core.heard(b"rollout-0", 1234.5)
    assert run.pool.get(b"rollout-0").last_seen == 1234.5
    assert not run.core.heard(b"stranger", 1234.5)
