"""An agent framework from PyPI through the endpoint: the OpenAI Agents SDK version of the
calculator agent (areal/tasks/agents/calculator_sdk.py) runs its own loop (tool call, tool
result, answer) against the real endpoint, and its second request extends its first, so
the episode is one training segment of exactly the sampled tokens."""

from __future__ import annotations

import pytest
from agent_helpers import (
    ScriptedEngine,
    build_qwen_style_tokenizer,
    char_ids,
    make_runner,
    qwen_ids,
)

from areal.messages import EpisodeEnd
from areal.tasks.base import Verdict
from areal.tasks.tool_arithmetic import ToolArithmeticTask

pytest.importorskip("agents", reason="openai-agents is not installed (pip install -e '.[test]')")

from areal.tasks.agents import calculator_sdk

TOK = build_qwen_style_tokenizer()
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")
CALL = char_ids(
    TOK, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "482*37"}}\n</tool_call>'
) + [IM_END]
ANSWER = qwen_ids(TOK, "#17834") + [IM_END]


async def test_the_agents_sdk_calculator_agent_runs_through_the_endpoint_as_one_segment():
    engine = ScriptedEngine([CALL, ANSWER])
    runner, params = await make_runner(engine, calculator_sdk.run, tokenizer=TOK)
    runner.task = ToolArithmeticTask()
    try:
        episode = await runner.run(
            "r", params, prompt_id="p", prompt_text="482*37=?\n", reference=17834
        )
    finally:
        await runner.close()
    assert (episode.end, episode.outcome.verdict, episode.outcome.reward) == (
        EpisodeEnd.AGENT,
        Verdict.OK,
        1.0,
    ), episode.outcome.detail
    assert (episode.num_calls, episode.num_tool_calls, len(episode.segments)) == (2, 1, 1)
    (segment,) = episode.segments
    first_prompt, second_prompt = engine.prompts
    assert second_prompt[: len(first_prompt) + len(CALL)] == first_prompt + CALL
    rendered = TOK.decode(second_prompt[len(first_prompt) + len(CALL) :])
    assert rendered == (
        "\n<|im_start|>user\n<tool_response>\n17834\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    sampled = [
        t for t, m in zip(segment.tokens.token_ids, segment.tokens.loss_mask, strict=True) if m
    ]
    assert sampled == CALL + ANSWER
