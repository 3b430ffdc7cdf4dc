"""Dynamic sampling as the controller's group filter: which groups it drops, that it is
registered from the config, and the clear failure when every group has equal rewards.
(A real run with it is in test_correction_runs.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from areal.config import load_config
from areal.controller import Controller, RunFailed
from areal.controller.dynamic_sampling import REASON, DynamicSampling
from areal.controller.ledger import Group, Purpose, Sample, Stage
from areal.tasks.base import Prompt
from areal.types import Trajectory


def _group(rewards: list[float], group_id: int = 0) -> Group:
    group = Group(
        group_id=group_id,
        purpose=Purpose.TRAIN,
        prompt=Prompt(prompt_id=f"p{group_id}", text="x", reference="a"),
        prompt_ids=np.array([1, 2], np.int32),
        admitted_version=0,
    )
    for index, reward in enumerate(rewards):
        traj = Trajectory.from_generation(
            prompt_id=f"p{group_id}",
            group_id=group_id,
            prompt_ids=[1, 2],
            output_ids=[3, 4],
            output_logprobs=[-1.0, -1.0],
            output_versions=[0, 0],
        )
        traj.reward = reward
        group.samples.append(
            Sample(group_id=group_id, index=index, stage=Stage.DONE, trajectory=traj)
        )
    return group


def _cfg(*overrides: str):
    return load_config(overrides=["trainer.advantage.dynamic_sampling=true", *overrides])


def test_groups_with_equal_rewards_are_dropped_and_others_kept():
    check = DynamicSampling(_cfg())
    assert check(_group([1.0, 1.0, 1.0, 1.0])) == REASON == "zero_advantage"
    assert check(_group([0.0, 0.0])) == REASON
    assert check(_group([0.0, 1.0, 1.0])) is None
    assert check.num_in_a_row == 0


def test_too_many_drops_in_a_row_fail_the_run_with_the_fix():
    check = DynamicSampling(_cfg("trainer.advantage.dynamic_sampling_max_drops=3"))
    assert check(_group([1.0, 1.0])) == REASON
    assert check(_group([0.5, 0.0])) is None  # a group with signal resets the count
    assert check(_group([1.0, 1.0])) == check(_group([0.0, 0.0])) == REASON
    with pytest.raises(
        RunFailed,
        match=r"dropped 3 prompt groups in a row.*the last: \[1.0\].*"
        r"dynamic_sampling_max_drops",
    ):
        check(_group([1.0, 1.0]))
    never = DynamicSampling(_cfg("trainer.advantage.dynamic_sampling_max_drops=0"))
    assert all(never(_group([1.0, 1.0])) == REASON for _ in range(500))


def test_the_controller_registers_it_only_when_asked():
    assert not Controller(load_config()).group_filters
    (check,) = Controller(_cfg()).group_filters
    assert isinstance(check, DynamicSampling)
