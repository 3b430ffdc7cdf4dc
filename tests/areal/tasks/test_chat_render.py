"""OpenAI messages as tokens and sampled text as OpenAI replies: the template's rendering of
new messages after a sampled turn (Qwen2.5-style and bracket), the cases where a template
cannot extend a conversation (a new segment then), and tool calls parsed from the text."""

from __future__ import annotations

import json

import pytest
from qwen_style import build_qwen_style_tokenizer

from areal.models.tiny import build_char_tokenizer
from areal.tasks.chat_render import (
    ChatError,
    ChatFormat,
    normalize_messages,
    normalize_tools,
    same_message,
)
from areal.tasks.tools import Calculator

TOOLS = normalize_tools([Calculator().definition()])
USER = normalize_messages([{"role": "user", "content": "482*37=?\n"}])


def tool_turn(reply, content="17834"):
    return normalize_messages(
        [
            reply.message(),
            {"role": "tool", "tool_call_id": reply.tool_calls[0]["id"], "content": content},
        ]
    )


def test_qwen_style_continuation_is_the_templates_text_after_the_sampled_end_of_turn():
    chat = ChatFormat(build_qwen_style_tokenizer())
    assert (chat.format, chat.closing) == ("chat", "<|im_end|>\n")
    reply = chat.parse(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "482*37"}}</tool_call>',
        "<|im_end|>",
        TOOLS,
        "auto",
    )
    assert reply.content is None and json.loads(reply.tool_calls[0]["function"]["arguments"]) == {
        "expression": "482*37"
    }
    history = USER + tool_turn(reply)[:1]
    text = chat.continuation(history, tool_turn(reply)[1:], TOOLS, "<|im_end|>")
    assert text == (
        "\n<|im_start|>user\n<tool_response>\n17834\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # A turn cut by its budget gets the template's whole closing first.
    assert chat.continuation(history, tool_turn(reply)[1:], TOOLS, None).startswith(
        "<|im_end|>\n<|im_start|>user"
    )
    # A stop token the template never writes there: no continuation (a new segment).
    assert chat.continuation(history, tool_turn(reply)[1:], TOOLS, "<|endoftext|>") is None


def test_bracket_format_renders_the_warm_start_text():
    chat = ChatFormat(build_char_tokenizer())
    assert chat.format == "bracket"
    assert chat.render(USER, TOOLS, add_generation_prompt=True) == "482*37=?\n"
    reply = chat.parse("[482*37]", "]", TOOLS, "auto")
    assert reply.tool_calls[0]["function"]["name"] == "calculator"
    text = chat.continuation(USER + tool_turn(reply)[:1], tool_turn(reply)[1:], TOOLS, "]")
    assert text == "=17834\n"
    # Without tools (or tool_choice none) the same text is a plain reply.
    assert chat.parse("[482*37]", "]", [], "auto").content == "[482*37]"
    assert chat.parse("[482*37]", "]", TOOLS, "none").tool_calls == []
    assert chat.end_of_turn_ids(True) == chat.encode("<|endoftext|>]")


def test_a_template_that_rewrites_earlier_turns_gives_no_continuation():
    tokenizer = build_qwen_style_tokenizer()
    # Renders only the last message: a longer conversation is no extension of a shorter one.
    tokenizer.chat_template = "{{ messages[-1].content }}{{ '<|im_end|>' }}"
    chat = ChatFormat(tokenizer)
    history = normalize_messages(
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    )
    assert (
        chat.continuation(
            history, normalize_messages([{"role": "user", "content": "c"}]), [], "<|im_end|>"
        )
        is None
    )


def test_malformed_calls_stay_in_the_content_and_are_counted():
    chat = ChatFormat(build_qwen_style_tokenizer())
    text = (
        'ok <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}'
        "</tool_call> <tool_call>{bad}</tool_call>"
    )
    reply = chat.parse(text, "<|im_end|>", TOOLS, "auto")
    assert len(reply.tool_calls) == 1 and reply.num_tool_errors == 1
    assert reply.content == "ok  <tool_call>{bad}</tool_call>"
    bracket = ChatFormat(build_char_tokenizer()).parse("482*37]", "]", TOOLS, "auto")
    assert bracket.tool_calls == [] and bracket.num_tool_errors == 1


def test_messages_are_normalized_and_compared_as_turns():
    a = normalize_messages(
        [
            {"role": "developer", "content": [{"type": "text", "text": "s"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "x",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"a": 1, "b": 2}'},
                    }
                ],
            },
        ]
    )
    b = normalize_messages(
        [
            {"role": "system", "content": "s"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "y",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"b":2,"a":1}'},
                    }
                ],
            },
        ]
    )
    assert all(same_message(x, y) for x, y in zip(a, b, strict=True))
    assert a[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    with pytest.raises(ChatError, match="only text content") as err:
        normalize_messages([{"role": "user", "content": [{"type": "image_url"}]}])
    assert err.value.param == "messages[0].content[0]"
    with pytest.raises(ChatError, match="tools\\[0\\]"):
        normalize_tools([{"type": "retrieval"}])
