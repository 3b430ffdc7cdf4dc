"""The episode loop over the real torch engine: token accounting across turns, a weight
update in the middle of the second turn (every model token's log-prob equals a full
forward of its own version's weights over prompt + turns + observations), and endings:
a failing or slow environment, the turn limit, the token limit."""

from __future__ import annotations

import pytest
from episode_helpers import DONE, ScriptedEnvironment, check_update_in_turn_two, segments

from areal.messages import EpisodeEnd
from areal.models.tokenizer import load_tokenizer
from areal.tasks.base import Verdict
from areal.workers.rollout.engine import FinishReason, SamplingParams
from areal.workers.rollout.episode import EpisodeLimits, EpisodeResult, EpisodeRunner
from areal.workers.rollout.interruptible import InterruptibleGenerator


@pytest.fixture
async def make_runner(make_engine, weights_dirs):
    tokenizer = load_tokenizer(weights_dirs[0])

    async def make(script, **limits) -> tuple[EpisodeRunner, ScriptedEnvironment]:
        generator = InterruptibleGenerator(await make_engine(), version=0)
        env = ScriptedEnvironment(script)
        limits.setdefault("max_turns", 4)
        return EpisodeRunner(generator, env, tokenizer, EpisodeLimits(**limits)), env

    return make


async def test_tokens_of_each_turn_keep_their_provenance_across_an_update_in_turn_two(
    make_runner, weights_dirs, reference_models
):
    runner, env = await make_runner(["obs one\n", "obs two\n", DONE], max_turn_tokens=60)
    await check_update_in_turn_two(runner, env, weights_dirs[1], reference_models)


async def test_a_failing_environment_ends_the_episode_with_an_error_and_keeps_it(make_runner):
    runner, _ = await make_runner(["obs\n", ValueError("tool server down")], max_turn_tokens=5)
    result = await runner.run("e1", [5, 6, 7], SamplingParams(max_new_tokens=100))
    assert result.end is EpisodeEnd.ERROR and result.outcome.verdict is Verdict.ERROR
    assert "tool server down" in result.outcome.detail and result.outcome.reward == 0.0
    assert segments(result) == [(True, 5), (False, 4), (True, 5)]  # nothing lost


async def test_a_slow_environment_times_out(make_runner):
    runner, _ = await make_runner([5.0], max_turn_tokens=5, step_timeout_s=0.2)
    result = await runner.run("e2", [5, 6, 7], SamplingParams(max_new_tokens=100))
    assert (result.end, result.outcome.verdict) == (EpisodeEnd.ERROR, Verdict.TIMEOUT)
    assert "episode.step_timeout_s=0.2" in result.outcome.detail and result.tool_s >= 0.2


async def test_the_turn_limit_ends_an_episode_the_environment_never_ends(make_runner):
    runner, env = await make_runner(["more\n"], max_turns=3, max_turn_tokens=4)
    result = await runner.run("e3", [5, 6, 7], SamplingParams(max_new_tokens=100))
    assert (result.end, result.outcome.verdict, result.outcome.reward) == (
        EpisodeEnd.TURN_LIMIT,
        Verdict.NO_ANSWER,
        0.0,
    )
    assert result.finish_reason is FinishReason.LENGTH and result.num_turns == 3
    assert "episode.max_turns=3" in result.outcome.detail
    # The observation after the last turn is not appended: the episode ends on a model turn.
    assert segments(result) == [(True, 4), (False, 5)] * 2 + [(True, 4)]
    assert env.was_last_turn == [False, False, True]


async def test_the_token_budget_covers_model_and_observation_tokens(make_runner):
    runner, _ = await make_runner(["x" * 30], max_turns=10, max_turn_tokens=10)
    result = await runner.run("e4", [5, 6, 7], SamplingParams(max_new_tokens=60))
    assert result.end is EpisodeEnd.TOKEN_LIMIT and result.outcome.verdict is Verdict.NO_ANSWER
    assert segments(result) == [(True, 10), (False, 30), (True, 10)]  # 30 more do not fit
    assert "does not fit" in result.outcome.detail
    # The budget, not the turn cap, cuts the last turn short.
    runner, _ = await make_runner(["y\n"], max_turns=10)
    result = await runner.run("e5", [5, 6, 7], SamplingParams(max_new_tokens=8))
    assert result.end is EpisodeEnd.TOKEN_LIMIT and len(result.token_ids) <= 8


def test_model_tokens_carry_log_probs_and_versions_and_observations_neither():
    result = EpisodeResult()
    result.append([5, 6], [-0.5, -0.25], [3, 3])
    result.append([7], None, None)  # an observation
    assert result.logprobs == [-0.5, -0.25, 0.0] and result.versions == [3, 3, -1]
    assert result.loss_mask == [True, True, False]
    with pytest.raises(ValueError, match="observation tokens with neither"):
        result.append([8], [-1.0], None)
    assert result.token_ids == [5, 6, 7]  # the refused tokens are not half-appended
