"""How agent episodes end: a reward (number, RewardOutcome, per completion id), or a failure
that is kept and reported (raised, timed out, an unusable reward, no call at all), or a
limit the endpoint refused a call for. Also: the worker-side Generated of each."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import openai
import pytest
from agent_helpers import ScriptedEngine, build_qwen_style_tokenizer, make_runner, qwen_ids

from areal.messages import EpisodeEnd
from areal.tasks.base import RewardOutcome, Verdict
from areal.workers.rollout.agent.runner import generated_agent_episode

TOK = build_qwen_style_tokenizer()
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")
USER = [{"role": "user", "content": "hello"}]


async def episode_of(agent, *, replies=None, overrides=(), engine=None):
    engine = engine or ScriptedEngine(replies or [qwen_ids(TOK, "hi") + [IM_END]] * 8)
    runner, params = await make_runner(engine, agent, tokenizer=TOK, overrides=overrides)
    try:
        return await runner.run("r", params, prompt_id="p", prompt_text="q", reference=7)
    finally:
        await runner.close()


async def one_call(client) -> str:
    return (await client.chat.completions.create(model="m", messages=USER)).id


async def test_a_reward_outcome_keeps_its_verdict_and_the_sample_is_the_tasks():
    async def agent(client, sample):
        assert (sample.prompt_id, sample.prompt, sample.reference) == ("p", "q", 7)
        await one_call(client)
        return RewardOutcome(reward=0.5, verdict=Verdict.WRONG, detail="partial")

    episode = await episode_of(agent)
    assert (episode.end, episode.outcome.verdict, episode.rewards) == (
        EpisodeEnd.AGENT,
        Verdict.WRONG,
        [0.5],
    )


@pytest.mark.parametrize(
    "behaviour, verdict, detail",
    [
        ("raise", Verdict.ERROR, "the agent raised ValueError: tool server down"),
        ("timeout", Verdict.TIMEOUT, "agent.timeout_s=0.5"),
        ("nan", Verdict.ERROR, "is not a finite number"),
        ("text", Verdict.ERROR, "the agent returned a str"),
        ("stranger", Verdict.ERROR, "not one of this episode's calls"),
    ],
)
async def test_a_failing_agent_ends_in_an_error_and_keeps_what_it_sampled(
    behaviour, verdict, detail
):
    async def agent(client, sample):
        await one_call(client)
        if behaviour == "raise":
            raise ValueError("tool server down")
        if behaviour == "timeout":
            await asyncio.sleep(30)
        return {"nan": math.nan, "text": "1.0", "stranger": {"chatcmpl-x": 1.0}}[behaviour]

    episode = await episode_of(agent, overrides=["agent.timeout_s=0.5"])
    assert (episode.end, episode.outcome.verdict, episode.outcome.reward) == (
        EpisodeEnd.ERROR,
        verdict,
        0.0,
    )
    assert detail in episode.outcome.detail
    assert len(episode.segments) == 1 and episode.rewards == [0.0]  # kept, no reward
    msg = generated_agent_episode("r", episode, np.asarray([1, 2], np.int32))
    assert msg.episode_end is EpisodeEnd.ERROR and msg.verdict is verdict
    assert len(msg.output_ids) == 3 and msg.segment_rewards == [0.0]


async def test_an_agent_that_makes_no_call_sends_an_empty_completion_in_error():
    async def agent(client, sample):
        return 1.0

    episode = await episode_of(agent)
    assert episode.end is EpisodeEnd.ERROR and "no chat call" in episode.outcome.detail
    msg = generated_agent_episode("r", episode, np.asarray([1, 2], np.int32))
    assert msg.prompt_ids is None and msg.segment_prompt_lens == []
    assert len(msg.output_ids) == 0 and msg.reward == 0.0


async def test_calls_past_max_calls_are_refused_and_end_the_episode_at_its_turn_limit():
    async def agent(client, sample):
        await one_call(client)
        await one_call(client)
        with pytest.raises(openai.BadRequestError, match="agent.max_calls"):
            await one_call(client)
        raise RuntimeError("the agent gives up")

    episode = await episode_of(agent, overrides=["agent.max_calls=2"])
    assert (episode.end, episode.outcome.verdict, episode.num_calls) == (
        EpisodeEnd.TURN_LIMIT,
        Verdict.NO_ANSWER,
        2,
    )
    assert "gives up" in episode.outcome.detail


async def test_run_sampling_wins_unless_requests_may_set_their_own():
    seen: list[float] = []

    class Recording(ScriptedEngine):
        async def generate(self, request_id, prompt_ids, params):
            seen.append(params.temperature)
            return await super().generate(request_id, prompt_ids, params)

    async def agent(client, sample):
        await client.chat.completions.create(model="m", messages=USER, temperature=0.2)
        return 1.0

    await episode_of(agent, engine=Recording([qwen_ids(TOK, "a") + [IM_END]]))
    await episode_of(
        agent,
        engine=Recording([qwen_ids(TOK, "a") + [IM_END]]),
        overrides=["agent.request_sampling=true"],
    )
    assert seen == [1.0, 0.2]


async def test_a_cancelled_episode_closes_its_key_and_cancels_its_running_call():
    """What the worker does with the controller's Cancel: the episode's task is cancelled."""
    engine = ScriptedEngine([qwen_ids(TOK, "never") + [IM_END]])
    engine.hold()
    keep: dict[str, object] = {}

    async def agent(client, sample):
        keep["client"] = client.with_options(max_retries=0)
        await one_call(client)
        return 1.0

    runner, params = await make_runner(engine, agent, tokenizer=TOK)
    try:
        task = asyncio.create_task(
            runner.run("r", params, prompt_id="p", prompt_text="q", reference=None)
        )
        async with asyncio.timeout(30):
            while not engine.inside:  # the call is in the engine
                await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.inside == 0 and len(runner.registry) == 0  # call cancelled, key closed
        with pytest.raises(openai.AuthenticationError, match="has ended"):
            await keep["client"].chat.completions.create(model="m", messages=USER)
    finally:
        await runner.close()
