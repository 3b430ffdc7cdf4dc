"""The endpoint over real HTTP with the real `openai` client: keys (401), OpenAI-style 400s
for what is too large or not supported, streaming, log-probs, /v1/models, SDK retries that
do not fork the trajectory, and 256 concurrent sessions none of which waits for another."""

from __future__ import annotations

import asyncio

import httpx2
import openai
import pytest
from agent_helpers import LOGPROB, ScriptedEngine, build_qwen_style_tokenizer, make_runner, qwen_ids

from areal.messages import EpisodeEnd
from areal.tasks.base import Verdict

TOK = build_qwen_style_tokenizer()
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")
USER = [{"role": "user", "content": "hello"}]


def reply(text: str) -> list[int]:
    return qwen_ids(TOK, text) + [IM_END]


async def run_agent(agent, replies, *, engine=None, **kwargs):
    """(episode, runner's engine) of one episode of `agent`; the runner is closed after."""
    engine = engine or ScriptedEngine(replies)
    runner, params = await make_runner(engine, agent, tokenizer=TOK, **kwargs)
    try:
        return await runner.run("r", params, prompt_id="p", prompt_text="q", reference=None)
    finally:
        await runner.close()


async def test_keys_unknown_missing_or_of_an_ended_episode_get_401():
    seen: dict[str, object] = {}

    async def agent(client, sample):
        seen["url"], seen["key"] = str(client.base_url), client.api_key
        assert [m.id for m in (await client.models.list()).data] == ["policy"]
        stranger = client.with_options(api_key="areal-not-a-key")
        with pytest.raises(openai.AuthenticationError, match="belongs to no episode") as err:
            await stranger.chat.completions.create(model="m", messages=USER)
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
        async with httpx2.AsyncClient() as http:
            bare = await http.post(f"{seen['url']}chat/completions", json={})
        assert (
            bare.status_code == 401
            and "didn't provide an API key" in bare.json()["error"]["message"]
        )
        await client.chat.completions.create(model="m", messages=USER)
        seen["client"] = client
        return 1.0

    episode = await run_agent(agent, [reply("hi")])
    assert episode.end is EpisodeEnd.AGENT and episode.num_calls == 1


async def test_a_key_is_refused_once_its_episode_ended():
    engine = ScriptedEngine([reply("hi")])
    keep: dict[str, object] = {}

    async def agent(client, sample):
        keep["client"] = client.with_options(max_retries=0)
        await client.chat.completions.create(model="m", messages=USER)
        return 1.0

    runner, params = await make_runner(engine, agent, tokenizer=TOK)
    try:
        await runner.run("r", params, prompt_id="p", prompt_text="q", reference=None)
        with pytest.raises(openai.AuthenticationError, match="has ended"):
            await keep["client"].chat.completions.create(model="m", messages=USER)
    finally:
        await runner.close()
    assert len(engine.prompts) == 1


@pytest.mark.parametrize(
    "kwargs, param, code",
    [
        ({"n": 2}, "n", "unsupported_parameter"),
        ({"max_tokens": 1 << 20}, "max_tokens", "invalid_value"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
        ({"top_logprobs": 3, "logprobs": True}, "top_logprobs", "unsupported_parameter"),
        ({"temperature": 3.0}, "temperature", "invalid_value"),
        ({"response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "invalid_value",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",
            "invalid_value",
        ),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ],
)
async def test_what_cannot_be_served_is_an_openai_style_400(kwargs, param, code):
    async def agent(client, sample):
        request = {"model": "m", "messages": USER, **kwargs}
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(**request)
        assert (err.value.status_code, err.value.param, err.value.code) == (400, param, code)
        return 0.0

    episode = await run_agent(agent, [])
    assert episode.end is EpisodeEnd.ERROR  # made no call: nothing to train


async def test_request_bodies_over_the_limit_are_refused_before_parsing():
    async def agent(client, sample):
        big = [{"role": "user", "content": "x" * 5000}]
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="m", messages=big)
        assert (
            err.value.code == "request_too_large" and "agent.max_request_bytes" in err.value.message
        )
        async with httpx2.AsyncClient() as http:  # a body that lies about its length

            async def body():
                yield b'{"model": "m", "messages": ['
                yield b" " * 5000

            lying = await http.post(
                f"{client.base_url}chat/completions",
                content=body(),
                headers={"authorization": f"Bearer {client.api_key}"},
            )
            assert lying.status_code == 400
            assert lying.json()["error"]["code"] == "request_too_large"
            unknown = await http.get(f"{client.base_url}nowhere")
            assert unknown.status_code == 404 and "error" in unknown.json()
        return 0.0

    await run_agent(agent, [], overrides=["agent.max_request_bytes=4096"])


async def test_streamed_replies_and_logprobs_parse_with_the_client():
    async def agent(client, sample):
        stream = await client.chat.completions.create(
            model="m",
            messages=USER,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
        )
        parts, finish, usage, logprobs = [], None, None, []
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
                if choice.logprobs is not None:
                    logprobs += [entry.logprob for entry in choice.logprobs.content]
        assert ("".join(parts), finish, usage.completion_tokens) == ("hi there", "stop", 9)
        assert logprobs == [LOGPROB] * 9
        plain = await client.chat.completions.create(model="m", messages=USER, logprobs=True)
        assert [e.token for e in plain.choices[0].logprobs.content][:3] == ["b", "y", "e"]
        return 1.0

    episode = await run_agent(agent, [reply("hi there"), reply("bye")])
    assert episode.num_calls == 2 and len(episode.segments) == 2  # neither extends the other


async def test_sdk_retries_of_a_call_are_answered_by_it_and_not_sampled_again():
    engine = ScriptedEngine([reply("slow answer")])
    engine.hold()

    async def agent(client, sample):
        patient = client.with_options(timeout=0.3, max_retries=5)
        out = await patient.chat.completions.create(model="m", messages=USER)
        assert out.choices[0].message.content == "slow answer"
        return 1.0

    runner, params = await make_runner(engine, agent, tokenizer=TOK)
    try:
        episode_task = asyncio.create_task(
            runner.run("r", params, prompt_id="p", prompt_text="q", reference=None)
        )
        async with asyncio.timeout(30):  # the client times out and retries; then release it
            while not any(s.num_retries for s in runner.registry._open.values()):
                await asyncio.sleep(0.02)
        engine.released.set()
        episode = await episode_task
    finally:
        await runner.close()
    assert len(engine.prompts) == 1  # sampled once
    assert episode.num_calls == 1 and episode.num_retries >= 1
    assert episode.end is EpisodeEnd.AGENT and episode.outcome.verdict is Verdict.OK


@pytest.mark.slow
async def test_256_concurrent_sessions_do_not_wait_for_each_other():
    """Every call is held in the engine until all 256 are inside at once: if any request
    waited for another (a connection cap, a lock), the barrier would never fill."""
    num = 256
    engine = ScriptedEngine(lambda prompt: reply("ok"), barrier=num)
    engine.hold()

    async def agent(client, sample):
        out = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": sample.prompt_id}]
        )
        return float(out.choices[0].message.content == "ok")

    runner, params = await make_runner(engine, agent, tokenizer=TOK)
    try:
        async with asyncio.timeout(120):
            episodes = await asyncio.gather(
                *(
                    runner.run(f"r{i}", params, prompt_id=f"p{i}", prompt_text="", reference=None)
                    for i in range(num)
                )
            )
    finally:
        await runner.close()
    assert [e.outcome.reward for e in episodes] == [1.0] * num
    assert len(engine.prompts) == num and len(runner.registry) == 0
