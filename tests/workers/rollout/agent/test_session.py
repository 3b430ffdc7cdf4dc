"""Token-in, token-out through the real endpoint and the real `openai` client: what is
trained is exactly what was sampled, segments start where history stops extending, and
each segment gets its share of the rewards.

The engine is scripted (agent_helpers.py): these tests check the accounting around it.
"""

from __future__ import annotations

import json

import numpy as np
from agent_helpers import (
    CALCULATOR,
    LOGPROB,
    ScriptedEngine,
    build_qwen_style_tokenizer,
    char_ids,
    make_runner,
    qwen_ids,
)

from areal.messages import EpisodeEnd
from areal.tasks.base import Verdict
from areal.types import PROMPT_VERSION
from areal.workers.rollout.agent.runner import generated_agent_episode

TOK = build_qwen_style_tokenizer()
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")
# The model writes its call one character per token (never the added <tool_call> tokens)
# and with compact JSON: the chat template would render the same call differently.
CALL_TEXT = '<tool_call>{"name":"calculator","arguments":{"expression":"482*37"}}</tool_call>'
SAMPLED_CALL = char_ids(TOK, CALL_TEXT) + [IM_END]
SAMPLED_ANSWER = char_ids(TOK, "It is 17834.") + [IM_END]


CONVERSATIONS: list[list[dict]] = []


async def calculator_agent(client, sample):
    """Calls the calculator once, then answers; keeps its final conversation."""
    messages = [{"role": "user", "content": sample.prompt}]
    first = await client.chat.completions.create(
        model="policy", messages=messages, tools=[CALCULATOR]
    )
    (call,) = first.choices[0].message.tool_calls
    value = str(eval(json.loads(call.function.arguments)["expression"]))  # a toy calculator
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": value},
    ]
    second = await client.chat.completions.create(
        model="policy", messages=messages, tools=[CALCULATOR]
    )
    CONVERSATIONS.append(messages + [second.choices[0].message.model_dump(exclude_none=True)])
    return 1.0 if "17834" in second.choices[0].message.content else 0.0


async def test_trained_ids_are_the_sampled_ones_where_retokenizing_would_differ():
    engine = ScriptedEngine([SAMPLED_CALL, SAMPLED_ANSWER])
    runner, params = await make_runner(engine, calculator_agent, tokenizer=TOK)
    try:
        episode = await runner.run(
            "r0", params, prompt_id="p0", prompt_text="482*37?", reference=None
        )
    finally:
        await runner.close()
    assert (episode.end, episode.outcome.verdict, episode.rewards) == (
        EpisodeEnd.AGENT,
        Verdict.OK,
        [1.0],
    )
    (segment,) = episode.segments
    tokens = segment.tokens
    # The second call's prompt is the first's, its sampled tokens, then the template's
    # rendering of the tool message only.
    first_prompt, second_prompt = engine.prompts
    rendered = second_prompt[len(first_prompt) + len(SAMPLED_CALL) :]
    assert second_prompt[: len(first_prompt) + len(SAMPLED_CALL)] == first_prompt + SAMPLED_CALL
    assert TOK.decode(rendered) == (
        "\n<|im_start|>user\n<tool_response>\n17834\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert segment.prompt_ids == first_prompt
    assert tokens.token_ids == SAMPLED_CALL + rendered + SAMPLED_ANSWER
    assert tokens.loss_mask == [True] * len(SAMPLED_CALL) + [False] * len(rendered) + [True] * len(
        SAMPLED_ANSWER
    )
    sampled = [lp for lp, m in zip(tokens.logprobs, tokens.loss_mask, strict=True) if m]
    assert sampled == [LOGPROB] * (len(SAMPLED_CALL) + len(SAMPLED_ANSWER))
    assert {v for v, m in zip(tokens.versions, tokens.loss_mask, strict=True) if not m} == {
        PROMPT_VERSION
    }
    # Re-tokenizing the final conversation gives other ids: the trained ones are the sampled.
    conversation = CONVERSATIONS[-1]
    retokenized = qwen_ids(
        TOK, TOK.apply_chat_template(conversation, tools=[CALCULATOR], tokenize=False)
    )
    trained = segment.prompt_ids + tokens.token_ids
    assert retokenized != trained
    assert not _contains(retokenized, SAMPLED_CALL[: len(char_ids(TOK, "<tool_call>"))])
    # The Generated message carries exactly these arrays and the segment's prompt.
    msg = generated_agent_episode("r0", episode, np.asarray([1], np.int32))
    assert msg.prompt_ids.tolist() == first_prompt and msg.segment_prompt_lens == [
        len(first_prompt)
    ]
    assert (
        msg.output_ids.tolist() == tokens.token_ids and msg.loss_mask.tolist() == tokens.loss_mask
    )
    assert (msg.num_turns, msg.num_tool_calls, msg.segment_rewards, msg.reward) == (
        2,
        1,
        [1.0],
        1.0,
    )


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def text_reply(text: str, stop: bool = True) -> list[int]:
    return qwen_ids(TOK, text) + ([IM_END] if stop else [])


async def test_history_that_does_not_extend_starts_a_segment_and_rewards_discount_back():
    ids: list[str] = []

    async def agent(client, sample):
        async def ask(messages):
            out = await client.chat.completions.create(model="m", messages=messages)
            ids.append(out.id)
            return out.choices[0].message.content

        first = [{"role": "user", "content": "A"}]
        reply = await ask(first)
        await ask(
            first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
        )  # extends call 1
        await ask([{"role": "user", "content": "B"}])  # a new conversation: a new segment
        return {ids[0]: 0.0, ids[2]: 1.0}

    engine = ScriptedEngine([text_reply("x"), text_reply("y"), text_reply("z")])
    runner, params = await make_runner(
        engine, agent, tokenizer=TOK, overrides=["agent.discount=0.5"]
    )
    try:
        episode = await runner.run("r1", params, prompt_id="p1", prompt_text="", reference=None)
    finally:
        await runner.close()
    assert episode.end is EpisodeEnd.AGENT and len(episode.segments) == 2
    first, second = episode.segments
    assert engine.prompts[1][: len(engine.prompts[0])] == engine.prompts[0]
    assert first.prompt_ids == engine.prompts[0] and second.prompt_ids == engine.prompts[2]
    assert sum(first.tokens.loss_mask) == 4  # "x", "y" and their <|im_end|>
    # Returns: G3 = 1, G2 = 0 + 0.5 * 1, G1 = 0.25; segment 1 = G2 + r1, segment 2 = G3.
    assert episode.rewards == [0.5, 1.0]
    assert episode.outcome.reward == 1.0 and episode.outcome.verdict is Verdict.OK
    msg = generated_agent_episode("r1", episode, np.asarray([1], np.int32))
    assert msg.segment_prompt_lens == [len(engine.prompts[0]), len(engine.prompts[2])]
    assert msg.segment_output_lens == [len(first.tokens.token_ids), len(second.tokens.token_ids)]
    assert msg.reward == 1.0 and msg.segment_rewards == [0.5, 1.0]


async def test_an_edited_turn_starts_a_new_segment():
    async def agent(client, sample):
        first = [{"role": "user", "content": "A"}]
        out = await client.chat.completions.create(model="m", messages=first)
        edited = first + [
            {"role": "assistant", "content": out.choices[0].message.content + "!"},
            {"role": "user", "content": "more"},
        ]
        await client.chat.completions.create(model="m", messages=edited)
        return 1.0

    engine = ScriptedEngine([text_reply("x"), text_reply("y")])
    runner, params = await make_runner(engine, agent, tokenizer=TOK)
    try:
        episode = await runner.run("r2", params, prompt_id="p2", prompt_text="", reference=None)
    finally:
        await runner.close()
    # discount 1: the earlier segment's last call returns the later reward undiscounted
    assert len(episode.segments) == 2 and episode.rewards == [1.0, 1.0]
    assert TOK.decode(episode.segments[1].prompt_ids).count("x!") == 1  # rendered as sent


async def test_the_segment_budget_cuts_max_tokens_and_then_refuses_with_a_token_limit():
    import openai

    errors: list[Exception] = []

    async def agent(client, sample):
        messages = [{"role": "user", "content": "A"}]
        out = await client.chat.completions.create(model="m", messages=messages, max_tokens=1000)
        assert out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == 30
        messages += [
            out.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "go on"},
        ]
        try:
            await client.chat.completions.create(model="m", messages=messages)
        except openai.BadRequestError as err:
            errors.append(err)
            raise

    engine = ScriptedEngine([qwen_ids(TOK, "x" * 40)])
    runner, params = await make_runner(engine, agent, tokenizer=TOK, max_new_tokens=30)
    try:
        episode = await runner.run("r3", params, prompt_id="p3", prompt_text="", reference=None)
    finally:
        await runner.close()
    (err,) = errors
    assert err.code == "context_length_exceeded" and err.param == "messages"
    assert "rollout.max_new_tokens" in err.message
    assert (episode.end, episode.outcome.verdict, episode.outcome.reward) == (
        EpisodeEnd.TOKEN_LIMIT,
        Verdict.NO_ANSWER,
        0.0,
    )
    assert len(episode.segments[0].tokens.token_ids) == 30  # the first call's tokens kept


async def test_stop_sequences_end_the_reply_and_the_kept_tokens_end_with_them():
    async def agent(client, sample):
        out = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "A"}], stop=["END", "q"]
        )
        assert out.choices[0].message.content == "abc"
        assert out.choices[0].finish_reason == "stop"
        return 1.0

    engine = ScriptedEngine([qwen_ids(TOK, "abcENDxyz") + [IM_END]])
    runner, params = await make_runner(engine, agent, tokenizer=TOK)
    try:
        episode = await runner.run("r4", params, prompt_id="p4", prompt_text="", reference=None)
    finally:
        await runner.close()
    assert episode.end is EpisodeEnd.AGENT
    assert TOK.decode(episode.segments[0].tokens.token_ids) == "abcEND"
