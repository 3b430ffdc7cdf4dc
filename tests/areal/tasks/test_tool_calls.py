"""Tool calls in the model's text and tool results as the next context, in both formats.

The chat format is checked on a Qwen2.5-style tokenizer built here (qwen_style.py): the
tools reach the prompt through `apply_chat_template(..., tools=...)`, a model turn with a
<tool_call> block is parsed, and prompt + model turn + observation is exactly what the chat
template renders for the whole conversation, token for token.
"""

from __future__ import annotations

import json

import pytest
from qwen_style import IM_END, build_qwen_style_tokenizer

from areal.tasks.tool_calls import (
    ToolCall,
    chat_observation,
    parse_bracket_call,
    parse_chat_calls,
)
from areal.tasks.tools import Calculator, PythonTool

USER = [{"role": "user", "content": "What is 482*37?"}]


def _call_block(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_chat_calls_are_parsed_in_order_with_their_arguments():
    text = (
        "Let me compute. "
        + _call_block("calculator", {"expression": "482*37"})
        + "\n"
        + _call_block("python", {"code": "print(1)"})
    )
    assert parse_chat_calls(text) == [
        ToolCall(name="calculator", arguments={"expression": "482*37"}),
        ToolCall(name="python", arguments={"code": "print(1)"}),
    ]
    assert parse_chat_calls("The answer is 17834.") == []
    # Arguments encoded as a JSON string once more are decoded.
    doubly = (
        '<tool_call>{"name": "calculator", '
        '"arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    )
    assert parse_chat_calls(doubly) == [
        ToolCall(name="calculator", arguments={"expression": "1+1"})
    ]


@pytest.mark.parametrize(
    "text, error",
    [
        ("<tool_call>{name: calculator}</tool_call>", "not valid JSON"),
        ('<tool_call>["calculator"]</tool_call>', 'a tool call is {"name"'),
        ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "must be an object"),
        ('<tool_call>{"name": "calculator", "arguments": {}}', "never closed"),
    ],
)
def test_malformed_chat_calls_are_kept_with_the_reason(text, error):
    (call,) = parse_chat_calls(text)
    assert error in call.error


def test_bracket_call_is_the_text_after_the_last_open_bracket():
    assert parse_bracket_call("[482*37]", "calculator", "expression") == [
        ToolCall(name="calculator", arguments={"expression": "482*37"})
    ]
    assert parse_bracket_call("so [1] then [2*3]", "calculator", "expression") == [
        ToolCall(name="calculator", arguments={"expression": "2*3"})
    ]
    assert parse_bracket_call("#17834", "calculator", "expression") == []
    (bad,) = parse_bracket_call("482*37]", "calculator", "expression")
    assert bad.error == "a tool call is written [expression]"


def test_tools_reach_the_prompt_through_the_chat_template():
    tokenizer = build_qwen_style_tokenizer()
    tools = [Calculator().definition(), PythonTool().definition()]
    prompt = tokenizer.apply_chat_template(
        USER, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert "<tools>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    listed = [
        json.loads(line)
        for line in prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    ]
    assert [t["function"]["name"] for t in listed] == ["calculator", "python"]
    assert listed[0]["function"]["parameters"]["required"] == ["expression"]


def test_prompt_turn_and_observation_are_the_template_rendering_of_the_conversation():
    tokenizer = build_qwen_style_tokenizer()
    tools = [Calculator().definition()]
    prompt = tokenizer.apply_chat_template(
        USER, tools=tools, tokenize=False, add_generation_prompt=True
    )
    arguments = {"expression": "482*37"}
    turn_ids = tokenizer(_call_block("calculator", arguments) + IM_END, add_special_tokens=False)[
        "input_ids"
    ]
    assert turn_ids[-1] == tokenizer.eos_token_id  # the turn ends with the stop token
    # What the episode loop does: decode the turn, parse it, render the result.
    turn_text = tokenizer.decode(turn_ids, skip_special_tokens=True)
    assert parse_chat_calls(turn_text) == [ToolCall(name="calculator", arguments=arguments)]
    end_of_turn = tokenizer.decode(turn_ids[-1:], skip_special_tokens=False)
    observation = chat_observation(tokenizer, ["17834"], end_of_turn)
    observation_ids = tokenizer(observation, add_special_tokens=False)["input_ids"]
    whole = tokenizer.apply_chat_template(
        USER
        + [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "calculator", "arguments": arguments}}
                ],
            },
            {"role": "tool", "content": "17834"},
        ],
        tools=tools,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt + tokenizer.decode(turn_ids) + observation == whole
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert (
        prompt_ids + turn_ids + observation_ids
        == tokenizer(whole, add_special_tokens=False)["input_ids"]
    )


def test_several_results_render_as_consecutive_tool_messages():
    tokenizer = build_qwen_style_tokenizer()
    text = chat_observation(tokenizer, ["1", "error: division by zero"], IM_END)
    assert text == (
        "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n"
        "<tool_response>\nerror: division by zero\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_a_template_that_does_not_end_turns_with_the_stop_token_is_refused():
    tokenizer = build_qwen_style_tokenizer()
    with pytest.raises(ValueError, match="does not end an assistant message with '<eos>'"):
        chat_observation(tokenizer, ["1"], "<eos>")
