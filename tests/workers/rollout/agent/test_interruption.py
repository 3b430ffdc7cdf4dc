"""A weight update in the middle of an agent's chat call, on the real torch engine: the call
is interrupted and continued under the new weights invisibly to the agent (one reply), and
its tokens keep the version that sampled them: every sampled token's behaviour log-prob is
that of its own version's weights over the whole segment (a full forward pass)."""

from __future__ import annotations

import asyncio

import pytest
from agent_helpers import make_runner
from rollout_helpers import assert_close, recompute_logprobs

from areal.messages import EpisodeEnd
from areal.models.tokenizer import load_tokenizer
from areal.types import PROMPT_VERSION
from areal.workers.rollout.engine import DiskWeights

pytestmark = pytest.mark.slow


async def test_an_update_inside_the_second_call_continues_it_under_the_new_weights(
    make_engine, weights_dirs, reference_models
):
    tokenizer = load_tokenizer(weights_dirs[0])  # the embedded character tokenizer: bracket
    first_done = asyncio.Event()
    replies: list[str] = []
    lengths: list[int] = []

    async def agent(client, sample):
        messages = [{"role": "user", "content": "hello world\n"}]
        first = await client.chat.completions.create(model="m", messages=messages, max_tokens=30)
        lengths.append(first.usage.completion_tokens)
        first_done.set()
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "more\n"},
        ]
        second = await client.chat.completions.create(model="m", messages=messages, max_tokens=80)
        replies.append(second.choices[0].message.content)
        lengths.append(second.usage.completion_tokens)
        return 1.0

    engine = await make_engine()
    runner, params = await make_runner(
        engine, agent, tokenizer=tokenizer, max_new_tokens=200, context_len=engine.max_seq_len
    )
    params = type(params)(max_new_tokens=200, temperature=1.0, stop_token_ids=[])
    try:
        task = asyncio.create_task(
            runner.run("r", params, prompt_id="p", prompt_text="", reference=None)
        )
        await first_done.wait()
        async with asyncio.timeout(60):
            while not runner.generator.num_in_engine:  # the second call is in the engine
                await asyncio.sleep(0.005)
        probe = await runner.generator.generate(
            "probe", [5, 6, 7], type(params)(max_new_tokens=6)
        )  # decoded in the same batches as the second call
        assert len(probe.token_ids) == 6
        assert await runner.generator.update_weights(DiskWeights(weights_dirs[1]), 1) == 1
        episode = await task
    finally:
        await runner.close()
    assert episode.end is EpisodeEnd.AGENT and episode.num_interruptions == 1
    (segment,) = episode.segments
    tokens = segment.tokens
    sampled = [i for i, m in enumerate(tokens.loss_mask) if m]
    first, second = sampled[: lengths[0]], sampled[lengths[0] :]
    assert len(second) == lengths[1] and {tokens.versions[i] for i in first} == {0}
    second_versions = [tokens.versions[i] for i in second]
    switch = second_versions.index(1)
    assert switch > 0 and second_versions == [0] * switch + [1] * (len(second) - switch)
    assert {tokens.versions[i] for i, m in enumerate(tokens.loss_mask) if not m} == {PROMPT_VERSION}
    assert replies == [
        tokenizer.decode([tokens.token_ids[i] for i in second], skip_special_tokens=True)
    ]  # one reply, whole
    for version, model in enumerate(reference_models):
        positions = [i for i in sampled if tokens.versions[i] == version]
        recomputed = recompute_logprobs(
            model, segment.prompt_ids, tokens.token_ids, temperature=1.0
        )
        assert_close(
            [tokens.logprobs[i] for i in positions],
            recomputed[positions],
            atol=1e-4,
            what=f"log-probs of version-{version} tokens",
        )
