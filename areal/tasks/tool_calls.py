"""Tool calls in the model's text, and tool results as the text the model reads next.

Two formats:

- `chat` (Hugging Face models with a chat template, e.g. Qwen2.5): the tools are given to
  the chat template (`apply_chat_template(messages, tools=...)`), the model writes each call
  as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5's format, also
  Hermes', and what most tool-use chat templates render), then ends its turn with EOS. The
  results become `tool` messages rendered by the same chat template (`chat_observation`),
  followed by the start of the next assistant turn.
- `bracket` (tokenizers without a chat template, such as the embedded model's): the model
  writes `[argument]` and the turn ends at `]`; that is one call of the environment's
  first tool. The result is appended as `observation_template` filled with {result}
  (default `={result}` and a newline).

A call that cannot be parsed is kept as a `ToolCall` with an `error`, so that the model is
told what was wrong instead of the episode failing. Nothing here runs a tool.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)
BRACKET_OPEN, BRACKET_CLOSE = "[", "]"


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    """Why the call could not be parsed (then name/arguments are what could be read)."""


def parse_chat_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` block of a model turn, in order; an opening tag
    without its closing one is a malformed call."""
    calls = [_parse_call_json(body) for body in _CALL_RE.findall(text)]
    rest = _CALL_RE.sub("", text)
    if TOOL_CALL_OPEN in rest:
        calls.append(
            ToolCall(name="", error=f"{TOOL_CALL_OPEN} is never closed with {TOOL_CALL_CLOSE}")
        )
    return calls


def _parse_call_json(body: str) -> ToolCall:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall(
            name="",
            error=f"the tool call is not valid JSON ({err.msg} at "
            f"character {err.pos}): {body.strip()[:80]!r}",
        )
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall(name="", error='a tool call is {"name": <tool>, "arguments": {...}}')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models encode the arguments once more
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name=data["name"], error="the arguments of a tool call must be an object")
    return ToolCall(name=data["name"], arguments=arguments)


def parse_bracket_call(text: str, tool: str, argument: str) -> list[ToolCall]:
    """The call of a turn that ended at `]`: the text after its last `[`, as `argument` of
    `tool`. A turn without `]` at its end holds no call."""
    stripped = text.rstrip()
    if not stripped.endswith(BRACKET_CLOSE):
        return []
    start = stripped.rfind(BRACKET_OPEN)
    if start < 0:
        return [
            ToolCall(
                name=tool, error=f"a tool call is written {BRACKET_OPEN}{argument}{BRACKET_CLOSE}"
            )
        ]
    return [ToolCall(name=tool, arguments={argument: stripped[start + 1 : -1]})]


def chat_observation(tokenizer: Any, contents: list[str], end_of_turn: str) -> str:
    """Text that follows a model turn ending with `end_of_turn` (its stop token, e.g.
    <|im_end|>): the tool messages `contents` as the chat template renders them, then the
    start of the next assistant turn.

    Rendered as the difference between a short conversation with and without the tool
    messages, so the framing is exactly the template's. Raises ValueError when the template
    does not render a conversation as a prefix of its continuation, or does not end an
    assistant message with `end_of_turn`: such a template cannot frame episodes.
    """
    base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
    head = tokenizer.apply_chat_template(base, tokenize=False)
    whole = tokenizer.apply_chat_template(
        base + [{"role": "tool", "content": c} for c in contents],
        tokenize=False,
        add_generation_prompt=True,
    )
    if not whole.startswith(head):
        raise ValueError(
            "the chat template renders a conversation differently once tool "
            "messages follow; it cannot frame tool results of an episode"
        )
    cut = head.rfind(end_of_turn)
    if cut < 0 or head[cut + len(end_of_turn) :].strip():
        raise ValueError(
            f"the chat template does not end an assistant message with "
            f"{end_of_turn!r} (the stop token the model's turn ends with)"
        )
    return head[cut + len(end_of_turn) :] + whole[len(head) :]
