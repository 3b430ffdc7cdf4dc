"""The step record (report.py): what it says of a batch, and that a group's part of it is read
when the group completes (`step_columns`), the same as read at the step."""

from __future__ import annotations

import array
import dataclasses

import numpy as np

from decisions import Decisions, config, generated, scored

from areal.controller.ledger import Group, Purpose, Sample, Stage
from areal.controller.report import StepReport, eval_record, step_columns
from areal.messages import Completions, FinishReason, WorkerKind
from areal.tasks.base import Prompt, Verdict
from areal.types import Trajectory


def _complete(run: Decisions, group_id: int, rollout, reward) -> None:
    """Group `group_id` (2 samples) generated at version 1 (4 and 6 tokens, the second cut
    at the length limit, interrupted twice) and rewarded 1 (ok) and 0 (wrong)."""
    ids = [f"g{group_id}-s{i}-a0" for i in range(2)]
    run.on(rollout.identity, generated(ids[0], num_tokens=4, version=1))
    cut = generated(ids[1], num_tokens=6, version=1, num_interruptions=2)
    run.on(rollout.identity, dataclasses.replace(cut, finish_reason=FinishReason.LENGTH))
    run.on(reward.identity, scored(ids, [1.0, 0.0], [Verdict.OK, Verdict.WRONG]))


def _record(run: Decisions, groups) -> dict:
    report = StepReport()
    report.start_training()
    return report.step_record(
        1,
        3,
        groups,
        {},
        1.0,
        0.0,
        cfg=run.cfg,
        in_flight=0,
        score_queue=0,
        buffered=0,
        started=0.0,
    )


def _completed_groups(tmp_path, *overrides: str):
    run = Decisions(config(tmp_path, "trainer.batch_size=4", *overrides), tmp_path)
    run.admit(2)
    rollout, reward = run.join(WorkerKind.ROLLOUT), run.join(WorkerKind.REWARD)
    run.core.weights.version = 1  # published meanwhile (weight_sync.py owns it)
    for group_id in range(2):
        _complete(run, group_id, rollout, reward)
    return run, list(run.core.ledger.buffer)


def test_a_groups_part_of_the_step_record_is_read_as_it_completes(tmp_path):
    _, groups = _completed_groups(tmp_path)
    assert len(groups) == 2 and all(g.step_columns is not None for g in groups)
    part = groups[0].step_columns
    prompt = len(groups[0].prompt_ids)
    # oldest version, tokens, prompt tokens, reward, truncated, interruptions
    np.testing.assert_array_equal(
        part.columns,
        [[1, prompt + 4, prompt, 1.0, 0, 0], [1, prompt + 6, prompt, 0.0, 1, 2]],
    )
    assert part.num_ok == 1 and not part.episodes
    assert step_columns(groups[0]) is part  # read once


def test_the_values_the_ledger_writes_are_those_read_off_the_trajectories(tmp_path):
    """A group answered in one Completions (mixed versions, one cut and interrupted) and one
    answered a completion at a time: the step values the ledger wrote as completions and
    rewards came in equal those read off the group's trajectories and samples."""
    run = Decisions(config(tmp_path, "trainer.batch_size=4"), tmp_path)
    run.admit(2)
    rollout, reward = run.join(WorkerKind.ROLLOUT), run.join(WorkerKind.REWARD)
    run.core.weights.version = 2
    mixed = generated("g0-s0-a0", num_tokens=5, version=2, num_interruptions=1)
    mixed.versions = np.array([1, 1, 2, 2, 2], np.int32)
    cut = generated("g0-s1-a0", num_tokens=7, version=1, num_interruptions=3)
    cut.finish_reason = FinishReason.LENGTH
    run.on(rollout.identity, Completions.of([mixed, cut]))
    run.on(
        reward.identity, scored(["g0-s0-a0", "g0-s1-a0"], [0.0, 1.0], [Verdict.WRONG, Verdict.OK])
    )
    _complete(run, 1, rollout, reward)
    groups = list(run.core.ledger.buffer)
    assert len(groups) == 2
    for group in groups:
        written = step_columns(group)
        group.step_columns, group.step_values = None, array.array("d")  # as if never written
        read = step_columns(group)
        np.testing.assert_array_equal(written.columns, read.columns)
        assert (written.num_ok, written.episodes) == (read.num_ok, read.episodes) == (1, False)
    prompt = len(groups[0].prompt_ids)
    np.testing.assert_array_equal(
        groups[0].step_columns.columns,
        [[1, prompt + 5, prompt, 0.0, 0, 1], [1, prompt + 7, prompt, 1.0, 1, 3]],
    )


def test_the_step_record_of_a_batch(tmp_path):
    run, groups = _completed_groups(tmp_path)
    record = _record(run, groups)
    assert record["rollout/reward_mean"] == 0.5
    assert record["rollout/accuracy"] == 0.5
    assert record["rollout/completion_len_mean"] == 5.0
    assert record["rollout/completion_len_max"] == 6
    assert record["rollout/truncated_fraction"] == 0.5
    assert record["rollout/interruptions"] == 4
    # trained at version 2 (the record's is the one it published), sampled at 1
    assert record["staleness/hist"] == {"1": 4} and record["staleness/mean"] == 1.0
    assert not any(key.startswith("episode/") for key in record)


def test_groups_whose_part_was_not_kept_get_the_same_record(tmp_path):
    run, groups = _completed_groups(tmp_path)
    kept = _record(run, groups)
    for group in groups:
        group.step_columns = None  # as a group completed outside the controller would be
    fresh = _record(run, groups)
    for record in (kept, fresh):  # clocks differ between the two reports
        for key in [k for k in record if k.startswith("perf/")]:
            del record[key]
    assert fresh == kept


def test_shaping_metrics_still_read_the_trajectories(tmp_path):
    run, groups = _completed_groups(tmp_path, "trainer.advantage.mask_truncated=true")
    assert _record(run, groups)["rollout/truncated_masked"] == 2.0  # one per group


def _eval_group(group_id: int, *completions: tuple[list[int], list[bool] | None]) -> Group:
    group = Group(
        group_id=group_id,
        purpose=Purpose.EVAL,
        prompt=Prompt(prompt_id=f"p{group_id}", text="", reference=None),
        prompt_ids=np.array([1, 2], np.int32),
        admitted_version=0,
    )
    for index, (versions, mask) in enumerate(completions):
        trajectory = Trajectory.from_generation(
            prompt_id=f"p{group_id}",
            group_id=group_id,
            prompt_ids=group.prompt_ids,
            output_ids=np.arange(len(versions), dtype=np.int32),
            output_logprobs=np.zeros(len(versions), np.float32),
            output_versions=np.array(versions, np.int32),
            finish_reason="stop",
            output_loss_mask=mask,
        )
        group.samples.append(
            Sample(
                group_id=group_id,
                index=index,
                stage=Stage.DONE,
                trajectory=trajectory,
                verdict=Verdict.OK,
            )
        )
    return group


def test_an_evaluation_records_the_oldest_and_newest_version_that_sampled_a_token():
    # Prompt tokens and an episode's observations (version -1) sampled nothing.
    groups = [
        _eval_group(0, ([2, 2, 3], None), ([4, -1, 5], [True, False, True])),
        _eval_group(1, ([1, 6], None)),
    ]
    record = eval_record(groups, version=6, seconds=1.0)
    assert (record["eval/token_version_min"], record["eval/token_version_max"]) == (1.0, 6.0)
    unsampled = eval_record([_eval_group(2, ([-1, -1], [False, False]))], 6, 1.0)
    assert "eval/token_version_min" not in unsampled
