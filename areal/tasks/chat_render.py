"""OpenAI chat messages as the model's tokens, and the model's text as an OpenAI reply.

`ChatFormat` renders a conversation (`messages`, `tools`) with the tokenizer's chat
template, or, for tokenizers without one (the embedded model's), with `BRACKET_TEMPLATE`:
system and user contents as they are, an assistant's tool call as `[argument]`, a tool
message as `observation_template` (default `={result}\\n`), a final answer followed by EOS.

Token-in, token-out (docs/design.md section 11) needs one more thing from a template: the
text that follows a turn the model sampled, when the agent's next request extends it. That is
`continuation(history, new, ...)`: what the template renders for the `new` messages (and
the start of the next assistant turn), plus what it renders after the assistant's sampled
text (e.g. the newline after <|im_end|>). It is computed as the difference between two
renderings, so the framing is exactly the template's; when the template does not render
the longer conversation as an extension of the shorter (some templates rewrite earlier
turns), or the sampled turn does not end where the template ends one, it returns None and
the caller starts a new training segment from the whole conversation.

`parse` turns sampled text into the reply: `<tool_call>{...}</tool_call>` blocks (Qwen2.5,
format `chat`) or a turn ending at `]` (format `bracket`) become OpenAI `tool_calls`. A call
that cannot be parsed stays in the content and is counted.

Nothing here runs a model; it needs a tokenizer only for its template and special tokens.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

from areal.tasks.tool_calls import (
    BRACKET_CLOSE,
    BRACKET_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    parse_bracket_call,
    parse_chat_calls,
)

FORMATS = ("auto", "chat", "bracket")
DEFAULT_OBSERVATION_TEMPLATE = "={result}\n"
"""The bracket format's tool message (areal.tasks.tool_arithmetic.OBSERVATION)."""
ROLES = ("system", "developer", "user", "assistant", "tool")
_BLOCK_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r".*?" + re.escape(TOOL_CALL_CLOSE), re.S)

BRACKET_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- m.content -}}"
    "{%- for c in m.tool_calls or [] -%}"
    "{{- '[' -}}{{- c.function.arguments.values() | first -}}{{- ']' -}}"
    "{%- endfor -%}"
    "{%- if not m.tool_calls -%}{{- eos_token -}}{%- endif -%}"
    "{%- elif m.role == 'tool' -%}{{- observation_prefix + m.content + observation_suffix -}}"
    "{%- else -%}{{- m.content -}}{%- endif -%}"
    "{%- endfor -%}"
)
"""The chat template of tokenizers without one: the text the embedded model was warm-started
on (areal.tasks.tool_arithmetic), as a conversation."""


class ChatError(ValueError):
    """A request that cannot be rendered; `param` names the offending field (OpenAI's
    error.param)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, kw_only=True)
class Reply:
    """The assistant message of a sampled turn, as OpenAI returns it."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """[{"id", "type": "function", "function": {"name", "arguments": JSON text}}]"""
    num_tool_errors: int = 0
    """Tool calls in the text that could not be parsed (left in the content)."""

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


# -- messages ---------------------------------------------------------------------------------


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in (
                "text",
                "input_text",
                "output_text",
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatError(
                    f"{where}[{j}] is a {kind!r} part; only text content is supported",
                    f"{where}[{j}]",
                )
            if not isinstance(part.get("text"), str):
                raise ChatError(f"{where}[{j}].text must be a string", f"{where}[{j}].text")
            parts.append(part["text"])
        return "".join(parts)
    raise ChatError(f"{where} must be a string or a list of text parts", where)


def _arguments(text: Any) -> Any:
    """A tool call's arguments for templates: the JSON object the text holds (templates
    render objects; a JSON string rendered with `tojson` would be quoted twice)."""
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return text
    return value if isinstance(value, dict) else text


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """The request's messages in one canonical form (what templates render and what
    `same_message` compares): role, content text; an assistant's tool calls with their
    arguments as objects; a tool message's call id. 'developer' is a system message."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatError("messages must be a non-empty list", "messages")
    out = []
    for i, raw in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(raw, dict):
            raise ChatError(f"{where} must be an object", where)
        role = raw.get("role")
        if role not in ROLES:
            raise ChatError(
                f"{where}.role={role!r} is not one of {', '.join(ROLES)}", f"{where}.role"
            )
        message: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": _text(raw.get("content"), f"{where}.content"),
        }
        if role == "assistant" and raw.get("tool_calls"):
            message["tool_calls"] = [
                _tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(raw["tool_calls"])
            ]
        if role == "tool":
            message["tool_call_id"] = str(raw.get("tool_call_id") or "")
        if isinstance(raw.get("name"), str):
            message["name"] = raw["name"]
        out.append(message)
    return out


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ChatError(
            f"{where} must be {{'type': 'function', 'function': {{'name': ..., "
            "'arguments': ...}}",
            where,
        )
    return {
        "id": str(call.get("id") or ""),
        "type": "function",
        "function": {
            "name": function["name"],
            "arguments": _arguments(function.get("arguments") or "{}"),
        },
    }


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two normalized messages are the same turn (tool call ids aside: clients and
    frameworks rewrite them, templates rarely render them)."""

    def key(m: dict[str, Any]) -> tuple:
        calls = tuple(
            (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
            for c in m.get("tool_calls", ())
        )
        return m["role"], m["content"], calls, m.get("name")

    return key(a) == key(b)


def normalize_tools(tools: Any) -> list[dict[str, Any]]:
    """Function tools as templates take them: [{"type": "function", "function": {...}}]."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatError("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise ChatError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': "
                "..., 'parameters': {...}}}}",
                f"tools[{i}]",
            )
        out.append({"type": "function", "function": function})
    return out


# -- rendering --------------------------------------------------------------------------------


class ChatFormat:
    """Renders conversations and parses replies for one tokenizer (see the module doc)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        format: str = "auto",
        observation_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if format not in FORMATS:
            raise ValueError(f"agent.tool_format={format!r} is not one of {', '.join(FORMATS)}")
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if format == "chat" and not has_template:
            raise ValueError(
                "agent.tool_format='chat' but the tokenizer has no chat template; "
                "use agent.tool_format=bracket"
            )
        observation_template = observation_template or DEFAULT_OBSERVATION_TEMPLATE
        if "{result}" not in observation_template:
            raise ValueError(
                f"agent.observation_template={observation_template!r} has no {{result}}"
            )
        self.tokenizer = tokenizer
        self.format = format if format != "auto" else ("chat" if has_template else "bracket")
        prefix, _, suffix = observation_template.partition("{result}")
        self._kwargs = dict(template_kwargs or {})
        if self.format == "bracket":
            self._kwargs.update(
                chat_template=BRACKET_TEMPLATE, observation_prefix=prefix, observation_suffix=suffix
            )
        probe = self.render(
            [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}], []
        )
        self.closing = probe[probe.rfind("!") + 1 :]
        """What the template writes after an assistant's text (Qwen2.5: <|im_end|> and a
        newline; bracket: EOS)."""

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = False,
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self._kwargs,
        )
        if not isinstance(text, str):
            raise TypeError(f"the chat template rendered a {type(text).__name__}, not text")
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def end_of_turn_ids(self, tools_active: bool) -> list[int]:
        """Stop tokens a turn ends with besides the run's: the template's end of an assistant
        turn when it is one token (Qwen2.5's <|im_end|>), and `]` (bracket, tools on)."""
        ids = []
        closing = self.encode(self.closing)
        if closing and self.tokenizer.decode(closing[:1]) == self.closing.strip():
            ids.append(closing[0])
        if self.format == "bracket" and tools_active:
            ids += self.encode(BRACKET_CLOSE)[:1]
        return ids

    def continuation(
        self,
        history: list[dict[str, Any]],
        new: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        stop_text: str | None,
    ) -> str | None:
        """Text after the last sampled token of `history` (ending with the assistant turn
        the model sampled, as the agent sent it back) up to the start of the next assistant
        turn, with `new` messages between; None when the template does not render it as an
        extension (module doc). `stop_text`: the text of the stop token the turn ended
        with, None if it was cut (then the template's whole closing follows)."""
        base = self.render(history, tools)
        whole = self.render(history + new, tools, add_generation_prompt=True)
        if not whole.startswith(base):
            return None
        if stop_text is None:
            tail = self.closing
        else:
            cut = base.rfind(stop_text)
            if cut < 0:
                return None
            tail = base[cut + len(stop_text) :]
            if tail and not self.closing.endswith(tail):
                return None
        return tail + whole[len(base) :]

    # -- replies ------------------------------------------------------------------------------

    def parse(
        self, text: str, stop_text: str | None, tools: list[dict[str, Any]], tool_choice: Any
    ) -> Reply:
        """The reply of a turn whose text (special tokens skipped) is `text`, ended by the
        stop token `stop_text` (None: cut by its budget, or by a stop string)."""
        if not tools or tool_choice == "none" or stop_text is None:
            return Reply(content=text)
        if self.format == "bracket":
            return self._parse_bracket(text, stop_text, tools)
        return self._parse_chat(text)

    def _parse_chat(self, text: str) -> Reply:
        calls, kept, errors = [], [], 0
        position = 0
        for match in _BLOCK_RE.finditer(text):
            (call,) = parse_chat_calls(match.group(0))
            kept.append(text[position : match.start()])
            if call.error:
                errors += 1
                kept.append(match.group(0))
            else:
                calls.append(_openai_call(call.name, call.arguments))
            position = match.end()
        rest = text[position:]
        if TOOL_CALL_OPEN in rest:
            errors += 1  # opened and never closed
        kept.append(rest)
        text = "".join(kept)
        # With calls, the text around them (if any) is the message's content.
        content = (text.strip() or None) if calls else text
        return Reply(content=content, tool_calls=calls, num_tool_errors=errors)

    def _parse_bracket(self, text: str, stop_text: str, tools: list[dict[str, Any]]) -> Reply:
        if stop_text != BRACKET_CLOSE:
            return Reply(content=text)
        function = tools[0]["function"]
        properties = (function.get("parameters") or {}).get("properties") or {}
        argument = next(iter(properties), "input")
        (call,) = parse_bracket_call(text, function["name"], argument)
        if call.error:
            return Reply(content=text, num_tool_errors=1)
        start = text.rstrip().rfind(BRACKET_OPEN)
        return Reply(
            content=text[:start] or None, tool_calls=[_openai_call(call.name, call.arguments)]
        )


def _openai_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


__all__ = [
    "BRACKET_TEMPLATE",
    "ChatError",
    "ChatFormat",
    "Reply",
    "normalize_messages",
    "normalize_tools",
    "same_message",
]
