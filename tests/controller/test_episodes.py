"""The outcome an episode arrives with (controller/episodes.py): its environment's reward
as it is, and a clear ERROR outcome (never a number the trainer cannot use) when the
rollout worker broke the schema's contract."""

from __future__ import annotations

import numpy as np
import pytest

from areal.controller.episodes import rollout_outcome
from areal.messages import EpisodeEnd, FinishReason, Generated
from areal.tasks.base import Verdict


def _episode(reward: float, verdict: Verdict | None) -> Generated:
    return Generated(
        request_id="g0-s0-a0",
        output_ids=np.arange(3, dtype=np.int32),
        logprobs=np.zeros(3, np.float32),
        versions=np.zeros(3, np.int32),
        finish_reason=FinishReason.STOP,
        episode_end=EpisodeEnd.ENVIRONMENT,
        reward=reward,
        verdict=verdict,
        detail="env said so",
    )


def test_an_episode_keeps_its_environments_reward():
    outcome = rollout_outcome(_episode(0.5, Verdict.WRONG))
    assert (outcome.reward, outcome.verdict, outcome.detail) == (0.5, Verdict.WRONG, "env said so")


def test_an_episode_without_a_verdict_is_an_error():
    outcome = rollout_outcome(_episode(1.0, None))
    assert outcome.reward == 0.0 and outcome.verdict is Verdict.ERROR
    assert "without a verdict" in outcome.detail


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), float("-inf")])
def test_an_episode_whose_reward_is_not_finite_is_an_error(reward):
    outcome = rollout_outcome(_episode(reward, Verdict.OK))
    assert outcome.reward == 0.0 and outcome.verdict is Verdict.ERROR
    assert "not a finite number" in outcome.detail


def test_agent_episodes_report_calls_segments_retries_and_endpoint_seconds():
    from areal.controller.episodes import episode_metrics
    from areal.types import Trajectory

    def episode(turns, segments, retries):
        t = Trajectory.from_generation(
            prompt_id="p",
            group_id=0,
            prompt_ids=[1],
            output_ids=[2, 3],
            output_logprobs=[0.0, 0.0],
            output_versions=[0, 0],
        )
        t.episode = {
            "turns": turns,
            "tool_calls": 1,
            "tool_errors": 0,
            "tool_s": 0.1,
            "end": "agent",
            "agent": True,
            "segments": segments,
            "retries": retries,
            "queue_s": 0.1 * turns,
            "decode_s": 0.5 * turns,
            "model_tokens": 2,
            "observation_tokens": 0,
        }
        return t

    metrics = episode_metrics([episode(2, 1, 0), episode(4, 2, 3)], "episode/")
    assert metrics["episode/calls_mean"] == 3.0 and metrics["episode/segments_mean"] == 1.5
    assert metrics["episode/split_fraction"] == 0.5
    assert metrics["episode/retries_coalesced"] == 3
    assert metrics["episode/endpoint_queue_s_mean"] == pytest.approx(0.1)
    assert metrics["episode/endpoint_decode_s_mean"] == pytest.approx(0.5)
