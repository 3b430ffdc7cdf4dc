"""The episode loop over the real torch engine: token accounting across turns, a weight
update in the middle of the second turn (every model token's log-prob equals a full
forward of its own version's weights over prompt + turns + observations), and endings:
a failing or slow environment, the turn limit, the token limit."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from rollout_helpers import random_prompts
from test_interruptible_generation import assert_logprobs_per_version

from areal.messages import EpisodeEnd
from areal.models.hf import load_tokenizer
from areal.tasks.base import RewardOutcome, Verdict
from areal.tasks.environment import Environment, Episode, Observation, TurnRole
from areal.types import PROMPT_VERSION
from areal.workers.rollout.engine import DiskWeights, FinishReason, SamplingParams
from areal.workers.rollout.episode import (
    OBSERVATION_LOGPROB, EpisodeLimits, EpisodeResult, EpisodeRunner,
)
from areal.workers.rollout.interruptible import InterruptibleGenerator


class ScriptedEnvironment(Environment):
    """Answers model turn i with `script[i]`: observation text, a RewardOutcome, an
    exception (raised), or a number (seconds to sleep). Records the episodes it saw."""

    def __init__(self, script: list[Any]) -> None:
        super().__init__(task=None, tokenizer=None)
        self.script = script
        self.seen: list[Episode] = []
        self.was_last_turn: list[bool] = []
        self.answered = asyncio.Event()

    async def step(self, episode: Episode) -> Observation | RewardOutcome:
        self.seen.append(episode)
        self.was_last_turn.append(episode.is_last_turn)
        item = self.script[min(episode.num_model_turns, len(self.script)) - 1]
        self.answered.set()
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, float):
            await asyncio.sleep(item)
        if isinstance(item, str):
            return Observation(text=item, num_tool_calls=1, num_tool_errors=item == "err\n")
        return item


DONE = RewardOutcome(reward=1.0, verdict=Verdict.OK)


@pytest.fixture
async def make_runner(make_engine, weights_dirs):
    tokenizer = load_tokenizer(weights_dirs[0])

    async def make(script, **limits) -> tuple[EpisodeRunner, ScriptedEnvironment]:
        generator = InterruptibleGenerator(await make_engine(), version=0)
        env = ScriptedEnvironment(script)
        limits.setdefault("max_turns", 4)
        return EpisodeRunner(generator, env, tokenizer, EpisodeLimits(**limits)), env

    return make


def _segments(result: EpisodeResult) -> list[tuple[bool, int]]:
    """(is model text, length) of each run of tokens with one loss-mask value."""
    out: list[tuple[bool, int]] = []
    for sampled in result.loss_mask:
        if out and out[-1][0] == sampled:
            out[-1] = (sampled, out[-1][1] + 1)
        else:
            out.append((sampled, 1))
    return out


async def test_tokens_of_each_turn_keep_their_provenance_across_an_update_in_turn_two(
        make_runner, weights_dirs, reference_models):
    runner, env = await make_runner(["obs one\n", "obs two\n", DONE], max_turn_tokens=60)
    prompt = random_prompts(1, min_len=10, max_len=10, seed=5)[0]
    params = SamplingParams(max_new_tokens=300, temperature=1.0)
    episode = asyncio.create_task(runner.run("e0", prompt, params, prompt_id="p0",
                                             reference=7))
    await env.answered.wait()  # turn 1 is done; turn 2 is submitted next
    for _ in range(2000):
        if runner.generator.num_in_engine:
            break
        await asyncio.sleep(0.005)
    probe = await runner.generator.generate("probe", prompt, SamplingParams(max_new_tokens=6))
    assert len(probe.token_ids) == 6  # decoded in the same batches as turn 2
    assert await runner.generator.update_weights(DiskWeights(weights_dirs[1]), 1) == 1
    result = await episode

    assert (result.end, result.outcome, result.num_turns) == (EpisodeEnd.ENVIRONMENT, DONE, 3)
    assert (result.num_tool_calls, result.num_interruptions) == (2, 1)
    obs_one = runner.tokenizer("obs one\n", add_special_tokens=False)["input_ids"]
    obs_two = runner.tokenizer("obs two\n", add_special_tokens=False)["input_ids"]
    assert _segments(result) == [(True, 60), (False, len(obs_one)), (True, 60),
                                 (False, len(obs_two)), (True, 60)]
    turn1, turn2, turn3 = (slice(0, 60), slice(60 + len(obs_one), 120 + len(obs_one)),
                           slice(len(result.token_ids) - 60, None))
    assert result.token_ids[60:60 + len(obs_one)] == obs_one
    assert result.versions[turn1] == [0] * 60 and result.versions[turn3] == [1] * 60
    switch = result.versions[turn2].index(1)
    assert 0 < switch and result.versions[turn2] == [0] * switch + [1] * (60 - switch)
    observed = [i for i, sampled in enumerate(result.loss_mask) if not sampled]
    assert {result.versions[i] for i in observed} == {PROMPT_VERSION}
    assert {result.logprobs[i] for i in observed} == {OBSERVATION_LOGPROB}
    # Each model token's log-prob is its own version's, over the full context.
    assert_logprobs_per_version(prompt, result, reference_models, 1.0)
    # The environment saw the turns as text, the prompt and the reference.
    last = env.seen[-1]
    assert [t.role for t in last.turns] == [TurnRole.MODEL, TurnRole.OBSERVATION] * 2 + \
        [TurnRole.MODEL]
    assert last.turns[1].text == "obs one\n" and last.reference == 7 and last.prompt_id == "p0"
    assert last.turns[2].token_ids == result.token_ids[turn2]


async def test_a_failing_environment_ends_the_episode_with_an_error_and_keeps_it(make_runner):
    runner, _ = await make_runner(["obs\n", ValueError("tool server down")], max_turn_tokens=5)
    result = await runner.run("e1", [5, 6, 7], SamplingParams(max_new_tokens=100))
    assert result.end is EpisodeEnd.ERROR and result.outcome.verdict is Verdict.ERROR
    assert "tool server down" in result.outcome.detail and result.outcome.reward == 0.0
    assert _segments(result) == [(True, 5), (False, 4), (True, 5)]  # nothing lost


async def test_a_slow_environment_times_out(make_runner):
    runner, _ = await make_runner([5.0], max_turn_tokens=5, step_timeout_s=0.2)
    result = await runner.run("e2", [5, 6, 7], SamplingParams(max_new_tokens=100))
    assert (result.end, result.outcome.verdict) == (EpisodeEnd.ERROR, Verdict.TIMEOUT)
    assert "episode.step_timeout_s=0.2" in result.outcome.detail and result.tool_s >= 0.2


async def test_the_turn_limit_ends_an_episode_the_environment_never_ends(make_runner):
    runner, env = await make_runner(["more\n"], max_turns=3, max_turn_tokens=4)
    result = await runner.run("e3", [5, 6, 7], SamplingParams(max_new_tokens=100))
    assert (result.end, result.outcome.verdict, result.outcome.reward) == (
        EpisodeEnd.TURN_LIMIT, Verdict.NO_ANSWER, 0.0)
    assert result.finish_reason is FinishReason.LENGTH and result.num_turns == 3
    assert "episode.max_turns=3" in result.outcome.detail
    # The observation after the last turn is not appended: the episode ends on a model turn.
    assert _segments(result) == [(True, 4), (False, 5)] * 2 + [(True, 4)]
    assert env.was_last_turn == [False, False, True]


async def test_the_token_budget_covers_model_and_observation_tokens(make_runner):
    runner, _ = await make_runner(["x" * 30], max_turns=10, max_turn_tokens=10)
    result = await runner.run("e4", [5, 6, 7], SamplingParams(max_new_tokens=60))
    assert result.end is EpisodeEnd.TOKEN_LIMIT and result.outcome.verdict is Verdict.NO_ANSWER
    assert _segments(result) == [(True, 10), (False, 30), (True, 10)]  # 30 more do not fit
    assert "does not fit" in result.outcome.detail
    # The budget, not the turn cap, cuts the last turn short.
    runner, _ = await make_runner(["y\n"], max_turns=10)
    result = await runner.run("e5", [5, 6, 7], SamplingParams(max_new_tokens=8))
    assert result.end is EpisodeEnd.TOKEN_LIMIT and len(result.token_ids) <= 8
