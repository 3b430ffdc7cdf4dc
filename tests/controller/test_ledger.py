"""Ledger: samples move through their stages once; a lost worker's work is re-queued, never lost."""

from __future__ import annotations

import numpy as np
import pytest

from areal.controller.ledger import Ledger, Purpose, Sample, Stage
from areal.messages import Completions, EpisodeEnd, FinishReason, Generated
from areal.tasks.base import Prompt, RewardOutcome, Verdict
from areal.types import Trajectory

W1, W2, R1 = b"rollout-1", b"rollout-2", b"reward-1"


def _prompt(i=0):
    return Prompt(prompt_id=f"p{i}", text="1+1=", reference="2")


def _generated(sample, n=3, version=0):
    return Generated(
        request_id=sample.request_id,
        output_ids=np.arange(n, dtype=np.int32),
        logprobs=np.full(n, -0.5, np.float32),
        versions=np.full(n, version, np.int32),
        finish_reason=FinishReason.STOP,
    )


def _outcome(reward=1.0):
    return RewardOutcome(reward=reward, verdict=Verdict.OK if reward else Verdict.WRONG)


def _run_sample(ledger, sample, worker=W1, reward=1.0):
    ledger.start_generation(sample, worker, now=0.0)
    assert ledger.finish_generation(_generated(sample), worker) is sample
    ledger.start_scoring(sample, R1)
    return ledger.finish_scoring(sample.request_id, _outcome(reward), R1)


def _two_generating(ledger):
    """A group of two samples, a on W1 and b on W2, both being generated."""
    group = ledger.add_group(_prompt(), np.array([5], np.int32), size=2, version=0)
    a, b = ledger.pending.popleft(), ledger.pending.popleft()
    ledger.start_generation(a, W1, 0.0)
    ledger.start_generation(b, W2, 0.0)
    return group, a, b


@pytest.mark.parametrize("size", [1, 16])
def test_a_new_groups_samples_are_what_the_constructor_builds(size):
    """`Sample.first_attempts` sets the fields itself: each sample equals the dataclass's
    (every field compared, so a field added without it fails here), and none shares its
    segments list with another."""
    samples = Sample.first_attempts(7, size)
    assert samples == [Sample(group_id=7, index=i) for i in range(size)]
    assert [s.request_id for s in samples] == [f"g7-s{i}-a0" for i in range(size)]
    assert len({id(s.segments) for s in samples}) == size
    samples[0].next_attempt()
    assert samples[0].request_id == "g7-s0-a1"


def test_group_reaches_the_buffer_only_when_every_sample_is_scored():
    ledger = Ledger()
    group = ledger.add_group(_prompt(), np.array([5, 6], np.int32), size=3, version=0)
    assert [s.stage for s in group.samples] == [Stage.PENDING] * 3
    assert len(ledger.pending) == 3
    samples = [ledger.pending.popleft() for _ in range(3)]
    assert _run_sample(ledger, samples[0]) is None
    assert _run_sample(ledger, samples[1], reward=0.0) is None
    assert _run_sample(ledger, samples[2]) is group
    assert list(ledger.buffer) == [group] and ledger.num_buffered() == 3
    traj = group.trajectories()[1]
    assert traj.reward == 0.0 and list(traj.versions) == [-1, -1, 0, 0, 0]
    assert ledger.take_batch(1) == [group] and ledger.trained_group_ids == [group.group_id]
    with pytest.raises(RuntimeError, match="buffer holds 0 groups"):
        ledger.take_batch(1)


def test_a_group_is_sent_for_scoring_once_its_last_sample_is_generated():
    ledger = Ledger()
    group = ledger.add_group(_prompt(), np.array([5], np.int32), size=3, version=0)
    a, b, c = (ledger.pending.popleft() for _ in range(3))
    for sample in (a, b, c):
        ledger.start_generation(sample, W1, 0.0)
    assert ledger.finish_generation(_generated(a), W1) is a
    assert ledger.unscored(group) == []  # b and c still generating
    ledger.requeue(c)  # c's worker was lost: c is pending again
    assert ledger.finish_generation(_generated(b), W1) is b
    assert ledger.unscored(group) == []
    ledger.pending.popleft()
    ledger.start_generation(c, W2, 0.0)
    assert ledger.finish_generation(_generated(c), W2) is c
    assert ledger.unscored(group) == [a, b, c]
    ledger.start_scoring(a, R1)
    ledger.start_scoring(b, R1)
    assert ledger.unscored(group) == [c]  # only what no reward worker holds
    ledger.retry_scoring(a)
    assert ledger.unscored(group) == [a, c]


def test_lost_rollout_worker_requeues_its_generations_under_new_ids():
    ledger = Ledger()
    group, a, b = _two_generating(ledger)
    old_id = a.request_id
    requeued, rescore = ledger.release_worker(W1)
    assert requeued == [a] and rescore == [] and a.stage is Stage.PENDING
    assert a.request_id != old_id and list(ledger.pending) == [a]
    # The lost worker's late answer is ignored; the re-queued attempt is accepted.
    late = _generated(a)
    late.request_id = old_id
    assert ledger.finish_generation(late, W1) is None
    ledger.pending.popleft()
    assert _run_sample(ledger, a, worker=W2) is None
    assert ledger.finish_generation(_generated(b), W2) is b
    ledger.start_scoring(b, R1)
    assert ledger.finish_scoring(b.request_id, _outcome(), R1) is group


def test_a_stale_answer_does_not_count_toward_sending_the_group_for_scoring():
    ledger = Ledger()
    group, a, b = _two_generating(ledger)
    assert ledger.finish_generation(_generated(b), W2) is b
    late = _generated(a)
    ledger.release_worker(W1)  # a is pending again, under a new id
    assert ledger.finish_generation(late, W1) is None
    assert ledger.unscored(group) == []  # a is still to be generated
    assert ledger.finish_generation(_generated(a), W1) is None  # not started: stale too
    ledger.pending.popleft()
    ledger.start_generation(a, W2, 0.0)
    assert ledger.finish_generation(_generated(a), W2) is a
    assert ledger.unscored(group) == [a, b]


def test_lost_reward_worker_returns_its_samples_for_rescoring():
    ledger = Ledger()
    ledger.add_group(_prompt(), np.array([5], np.int32), size=1, version=0)
    sample = ledger.pending.popleft()
    ledger.start_generation(sample, W1, 0.0)
    ledger.finish_generation(_generated(sample), W1)
    ledger.start_scoring(sample, R1)
    requeued, rescore = ledger.release_worker(R1)
    assert requeued == [] and rescore == [sample] and sample.stage is Stage.SCORING
    # the lost worker's answer
    assert ledger.finish_scoring(sample.request_id, _outcome(), R1) is None
    ledger.start_scoring(sample, b"reward-2")
    assert ledger.finish_scoring(sample.request_id, _outcome(), b"reward-2") is not None


def test_eval_groups_never_enter_the_replay_buffer():
    ledger = Ledger()
    ledger.add_group(_prompt(0), np.array([5], np.int32), size=1, version=0)
    group = ledger.add_group(
        _prompt(1), np.array([5], np.int32), size=1, version=0, purpose=Purpose.EVAL, front=True
    )
    sample = ledger.pending.popleft()
    assert sample.group_id == group.group_id  # eval work goes first
    assert _run_sample(ledger, sample) is group
    assert not ledger.buffer


def test_untrained_positions_cover_running_and_buffered_groups_not_trained_ones():
    ledger = Ledger()
    groups = [
        ledger.add_group(_prompt(i), np.array([5], np.int32), size=1, version=0, position=10 + i)
        for i in range(4)
    ]
    for _ in groups[:3]:
        _run_sample(ledger, ledger.pending.popleft())
    ledger.take_batch(1)  # position 10 trained; 11, 12 buffered; 13 still pending
    assert ledger.untrained_positions() == [11, 12, 13]
    ledger.add_group(
        _prompt(9), np.array([5], np.int32), size=1, version=0, purpose=Purpose.EVAL
    )  # evaluation groups are not part of the stream
    assert ledger.untrained_positions() == [11, 12, 13]


def test_dropping_a_running_group_releases_every_stage_and_its_late_answers_are_stale():
    ledger = Ledger()
    group = ledger.add_group(_prompt(), np.array([5], np.int32), size=4, version=0)
    other = ledger.add_group(_prompt(1), np.array([6], np.int32), size=1, version=0)
    done, scoring, generating, _pending = [ledger.pending.popleft() for _ in range(3)] + [None]
    _run_sample(ledger, done)
    ledger.start_generation(scoring, W1, 0.0)
    ledger.finish_generation(_generated(scoring, n=5), W1)
    ledger.start_scoring(scoring, R1)
    ledger.start_generation(generating, W2, 0.0)

    dropped = ledger.drop_group(group)

    assert dropped.generating == {W2: [generating.request_id]}
    assert (dropped.num_unfinished, dropped.num_finished, dropped.num_tokens) == (2, 2, 3 + 5)
    assert [s.group_id for s in ledger.pending] == [other.group_id]
    assert group.group_id not in ledger.groups and ledger.dropped_group_ids == [group.group_id]
    assert ledger.finish_generation(_generated(generating), W2) is None
    assert ledger.finish_scoring(scoring.request_id, _outcome(), R1) is None
    assert all(ledger.groups[s.group_id] is other for s in ledger.in_flight())


def test_dropping_a_buffered_group_takes_it_out_of_the_buffer_once():
    ledger = Ledger()
    first = ledger.add_group(_prompt(0), np.array([5], np.int32), size=1, version=0)
    second = ledger.add_group(_prompt(1), np.array([5], np.int32), size=1, version=0)
    for _ in range(2):
        _run_sample(ledger, ledger.pending.popleft())
    dropped = ledger.drop_group(first)
    assert (dropped.num_unfinished, dropped.num_finished, dropped.num_tokens) == (0, 1, 3)
    assert list(ledger.buffer) == [second] and ledger.untrained_positions() == [second.position]
    with pytest.raises(ValueError, match="neither running nor buffered"):
        ledger.drop_group(first)
    assert ledger.take_batch(1) == [second]
    assert ledger.trained_group_ids == [second.group_id]
    assert ledger.dropped_group_ids == [first.group_id]


def test_evaluation_groups_are_never_dropped():
    ledger = Ledger()
    group = ledger.add_group(
        _prompt(), np.array([5], np.int32), size=1, version=0, purpose=Purpose.EVAL
    )
    with pytest.raises(ValueError, match="evaluation group"):
        ledger.drop_group(group)


def test_an_agent_episodes_segments_become_trajectories_of_its_group():
    ledger = Ledger()
    group = ledger.add_group(_prompt(), np.array([5], np.int32), size=1, version=0)
    sample = ledger.pending.popleft()
    ledger.start_generation(sample, W1, now=0.0)
    msg = Generated(
        request_id=sample.request_id,
        output_ids=np.arange(5, dtype=np.int32),
        logprobs=np.full(5, -0.5, np.float32),
        versions=np.zeros(5, np.int32),
        loss_mask=np.ones(5, bool),
        finish_reason=FinishReason.STOP,
        prompt_ids=np.array([7, 8, 9], np.int32),
        segment_prompt_lens=[2, 1],
        segment_output_lens=[2, 3],
        segment_rewards=[0.25, 1.0],
        reward=1.0,
        episode_end=EpisodeEnd.AGENT,
        verdict=Verdict.OK,
        num_turns=3,
    )
    assert ledger.finish_generation(msg, W1) is sample
    first, last = group.trajectories()
    assert (first.token_ids.tolist(), first.num_prompt_tokens, first.reward) == (
        [7, 8, 0, 1],
        2,
        0.25,
    )
    assert (last.token_ids.tolist(), last.num_prompt_tokens) == ([9, 2, 3, 4], 1)
    assert last is sample.trajectory and first.episode == {} and last.episode["segments"] == 2
    assert last.episode["model_tokens"] == 5
    ledger.start_scoring(sample, W1)
    done = ledger.finish_scoring(sample.request_id, _outcome(1.0), W1)
    assert done is group and [t.reward for t in group.trajectories()] == [0.25, 1.0]
    dropped = Ledger()
    g = dropped.add_group(_prompt(), np.array([5], np.int32), size=1, version=0)
    s = dropped.pending.popleft()
    dropped.start_generation(s, W1, now=0.0)
    msg.request_id = s.request_id
    dropped.finish_generation(msg, W1)
    assert dropped.drop_group(g).num_tokens == 5  # every segment's tokens are counted


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.dtype(">i4")])
def test_completions_are_recorded_as_each_alone_would_be_and_a_stale_one_is_left_out(dtype):
    # finish_completions keeps views of the message's arrays (native int32: as they are;
    # another dtype or byte order converted, as from_generation does) and reads each oldest
    # version from its first version run; a request the worker does not hold is left out.
    ledger = Ledger()
    group = ledger.add_group(_prompt(), np.array([5, 6], np.int32), size=3, version=0)
    a, b, c = (ledger.pending.popleft() for _ in range(3))
    for sample, worker in ((a, W1), (b, W1), (c, W2)):
        ledger.start_generation(sample, worker, now=2.0)
    alone = [_generated(a, n=2, version=1), _generated(b, n=3, version=0)]
    alone[1].versions = np.array([0, 1, 1], np.int32)
    msg = Completions.of([*alone, _generated(c, n=1)])
    msg.output_ids, msg.run_versions = msg.output_ids.astype(dtype), msg.run_versions.astype(dtype)
    msg.num_interruptions, msg.generation_s = [0, 2, 0], [1.5, 0.5, 0.1]
    assert ledger.finish_completions(msg, W1).samples == [a, b]  # c is W2's
    assert group.num_generated == 2 and c.stage is Stage.GENERATING
    assert a.trajectory is None and b.trajectory is None  # built when first read
    for sample, generated in zip((a, b), alone, strict=True):
        expected = Trajectory.from_generation(
            prompt_id="p0",
            group_id=group.group_id,
            prompt_ids=group.prompt_ids,
            output_ids=generated.output_ids,
            output_logprobs=generated.logprobs,
            output_versions=generated.versions,
            finish_reason="stop",
        )
        got = sample.generated
        assert sample.generated is got  # built once
        assert sample.stage is Stage.SCORING and sample.worker is None
        for name in ("token_ids", "logprobs", "versions", "loss_mask"):
            assert np.array_equal(getattr(got, name), getattr(expected, name)), name
        assert got.token_ids.dtype == np.int32 and got.versions.dtype == np.int32
        assert got.oldest_version() == expected.oldest_version()
        assert got.finish_reason == "stop" and got.num_prompt_tokens == 2
    assert a.generated.timings == {"submitted": 2.0, "generation": 1.5, "interruptions": 0.0}
    assert b.generated.timings == {"submitted": 2.0, "generation": 0.5, "interruptions": 2.0}
    assert ledger.finish_completions(msg, W1).samples == []  # the same answer again: stale


@pytest.mark.parametrize("with_outcomes", [False, True])
def test_recording_completions_says_which_groups_it_generated_or_completed(with_outcomes):
    # What the controller does after recording (a Score per group generated, or with the
    # rollout worker's outcomes each group completed) is gathered in the recording's pass.
    ledger = Ledger()
    groups = [
        ledger.add_group(_prompt(), np.array([5, 6], np.int32), size=2, version=0) for _ in range(2)
    ]
    samples = [ledger.pending.popleft() for _ in range(4)]  # g0: s0, s1; g1: s0, s1
    for sample in samples:
        ledger.start_generation(sample, W1, now=0.0)
    parts = [_generated(s, n=2, version=0) for s in samples[:3]]  # g1's second still running
    for part, verdict in zip(parts, (Verdict.OK, Verdict.WRONG, Verdict.OK), strict=True):
        part.reward, part.verdict = float(verdict is Verdict.OK), verdict
    recorded = ledger.finish_completions(Completions.of(parts), W1, with_outcomes)
    assert recorded.samples == samples[:3] and recorded.num_training == 3
    if not with_outcomes:
        assert recorded.generated == [groups[0]] and recorded.completed == []
        assert all(s.stage is Stage.SCORING for s in samples[:3])
        return
    assert recorded.generated == [] and recorded.completed == [groups[0]]
    assert [s.verdict for s in samples[:3]] == [Verdict.OK, Verdict.WRONG, Verdict.OK]
    assert groups[0].num_done == 2 and groups[0].num_ok == 1 and groups[1].num_done == 1
    ledger.complete(groups[0])
    (done,) = ledger.buffer
    assert done is groups[0] and [t.reward for t in done.trajectories()] == [1.0, 0.0]


def test_a_recorded_completion_is_read_without_its_trajectory_and_built_with_its_reward():
    # What the controller reads of a recorded completion before its batch is packed (its
    # tokens for the Score, its token count for a drop, whether it is an episode) needs no
    # Trajectory; one built after scoring carries the reward, as does one built before.
    ledger = Ledger()
    group = ledger.add_group(_prompt(), np.array([5, 6], np.int32), size=2, version=0)
    a, b = ledger.pending.popleft(), ledger.pending.popleft()
    for sample in (a, b):
        ledger.start_generation(sample, W1, now=0.0)
    msg = Completions.of([_generated(a, n=2, version=0), _generated(b, n=3, version=0)])
    msg.output_ids = np.arange(5, dtype=np.int32)
    assert ledger.finish_completions(msg, W1).samples == [a, b]
    assert a.is_generated and not a.is_episode
    assert a.output_ids().tolist() == [0, 1] and b.output_ids().tolist() == [2, 3, 4]
    assert a.num_output_tokens() == 2 and b.num_output_tokens() == 3
    assert a.trajectory is None and b.trajectory is None  # nothing above built one
    before = b.generated  # built before its reward came
    for sample, reward in ((a, 0.25), (b, 0.75)):
        ledger.start_scoring(sample, R1)
        ledger.finish_scoring(sample.request_id, _outcome(reward), R1)
    assert a.trajectory is None and a.generated.reward == 0.25  # built after
    assert before.reward == 0.75 and b.generated is before
    assert group.done and [t.reward for t in group.trajectories()] == [0.25, 0.75]
    assert a.generated.output_ids.tolist() == [0, 1]


def test_a_group_is_done_only_once_each_sample_is_scored_once():
    ledger = Ledger()
    group = ledger.add_group(_prompt(), np.array([5], np.int32), size=2, version=0)
    a, b = ledger.pending.popleft(), ledger.pending.popleft()
    assert _run_sample(ledger, a) is None and not group.done
    assert ledger.finish_scoring(a.request_id, _outcome(), R1) is None  # again: stale
    assert group.num_done == 1 and not group.done
    assert _run_sample(ledger, b) is group and group.done
