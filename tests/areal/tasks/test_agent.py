"""What an agent is (loading by import path) and how its rewards become the rewards of
training segments: credit per call, the discount back through earlier calls, the segment
rule (last call's return plus earlier calls' own rewards)."""

from __future__ import annotations

import math
import sys
import types

import pytest

from areal.tasks.agent import call_returns, episode_rewards, load_agent, segment_rewards
from areal.tasks.base import RewardOutcome, Verdict


def test_a_number_is_credited_to_the_last_call_with_a_verdict_from_its_sign():
    assert episode_rewards(1.0, ["a", "b"]) == (
        [0.0, 1.0],
        RewardOutcome(reward=1.0, verdict=Verdict.OK),
    )
    assert episode_rewards(0, ["a"])[1].verdict is Verdict.WRONG
    outcome = RewardOutcome(reward=0.5, verdict=Verdict.WRONG, detail="d")
    assert episode_rewards(outcome, ["a", "b"]) == ([0.0, 0.5], outcome)
    assert episode_rewards({"b": 2.0}, ["a", "b"])[0] == [0.0, 2.0]


@pytest.mark.parametrize(
    "returned, message",
    [
        (math.inf, "not a finite number"),
        (True, "returned a bool"),
        ("1", "returned a str"),
        ({"zz": 1.0}, "not one of this episode's calls"),
        ({"a": "1"}, "not a number"),
    ],
)
def test_unusable_rewards_say_why(returned, message):
    with pytest.raises((TypeError, ValueError), match=message):
        episode_rewards(returned, ["a"])
    with pytest.raises(ValueError, match="no chat call"):
        episode_rewards(1.0, [])


def test_returns_discount_back_and_segments_take_their_last_calls_return():
    assert call_returns([0.0, 0.0, 1.0], 0.5) == [0.25, 0.5, 1.0]
    assert call_returns([1.0, 2.0], 1.0) == [3.0, 2.0]
    # Calls 0, 1 in segment 0, call 2 in segment 1: segment 0 = G1 + r0.
    assert segment_rewards([0, 0, 1], [0.3, 0.0, 1.0], 0.5, 2) == [0.3 + 0.5, 1.0]
    # One segment, discount 1: the sum of the rewards.
    assert segment_rewards([0, 0, 0], [1.0, 2.0, 3.0], 1.0, 1) == [6.0]
    # Interleaved segments (parallel calls): order of finishing decides.
    assert segment_rewards([0, 1, 0], [0.0, 0.0, 1.0], 0.5, 2) == [1.0, 0.5]


def test_agents_load_from_functions_and_classes_with_params():
    module = types.ModuleType("agent_under_test")

    async def run(client, sample):
        return 1.0

    class Agent:
        def __init__(self, *, scale: float) -> None:
            self.scale = scale

        async def run(self, client, sample):
            return self.scale

    def sync(client, sample):
        return 1.0

    module.run, module.Agent, module.sync = run, Agent, sync
    sys.modules["agent_under_test"] = module
    try:
        assert load_agent("agent_under_test:run") is run
        assert load_agent("agent_under_test:Agent", {"scale": 2.0}).__self__.scale == 2.0
        with pytest.raises(ValueError, match="agent.params do not fit Agent"):
            load_agent("agent_under_test:Agent", {"nope": 1})
        with pytest.raises(ValueError, match="not an async function"):
            load_agent("agent_under_test:sync")
        with pytest.raises(ValueError, match="has no 'missing'"):
            load_agent("agent_under_test:missing")
        with pytest.raises(ValueError, match="cannot import module"):
            load_agent("no_such_module_here:run")
        with pytest.raises(ValueError, match="not an import path"):
            load_agent("run")
    finally:
        del sys.modules["agent_under_test"]
