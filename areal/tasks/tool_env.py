"""`ToolEnvironment` (episode.environment='tools'): the model calls tools until it answers.

After each model turn:

- the turn ended where calls end (at `]`, or at EOS, the chat template's end of turn) and
  holds tool calls -> run them (concurrently, each
  in its tool: the calculator in-process, Python in the sandbox) and return their results
  as the observation; a call that is malformed, names an unknown tool, fails or times out
  gets a result that says so (counted as a tool error), never a lost episode;
- otherwise the turn is the answer -> the episode ends with the task's reward of that
  turn's text (`Task.reward(text, reference)`, run in a thread: it may block).

On the last allowed turn (episode.max_turns) calls are not run: the episode ends there.

Params (`episode.params`): `tools` (names, default [calculator]; see tools.py),
`tool_options` ({tool: {option: value}}, e.g. {python: {timeout_s: 5}}), `format` (auto:
`chat` when the tokenizer has a chat template, else `bracket`; see tool_calls.py),
`observation_template` (bracket format) and `max_calls_per_turn`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from areal.tasks.base import RewardOutcome, Task
from areal.tasks.environment import Environment, Episode, Observation, Turn
from areal.tasks.tool_calls import (
    BRACKET_CLOSE,
    ToolCall,
    chat_observation,
    parse_bracket_call,
    parse_chat_calls,
)
from areal.tasks.tools import Tool, ToolResult, make_tool

FORMATS = ("auto", "chat", "bracket")


class ToolEnvironment(Environment):
    def __init__(
        self,
        *,
        task: Task,
        tokenizer: Any,
        tools: list[str] | None = None,
        tool_options: dict[str, dict[str, Any]] | None = None,
        format: str = "auto",
        observation_template: str = "={result}\n",
        max_calls_per_turn: int = 4,
    ) -> None:
        super().__init__(task=task, tokenizer=tokenizer)
        names = list(tools) if tools is not None else ["calculator"]
        if not names or len(set(names)) != len(names):
            raise ValueError(
                f"episode.params.tools={names!r} must name one or more distinct "
                "tools (calculator, python)"
            )
        options = dict(tool_options or {})
        unknown = set(options) - set(names)
        if unknown:
            raise ValueError(
                f"episode.params.tool_options names tools not in "
                f"episode.params.tools: {sorted(unknown)}"
            )
        self._tools: dict[str, Tool] = {n: make_tool(n, dict(options.get(n) or {})) for n in names}
        if format not in FORMATS:
            raise ValueError(f"episode.params.format={format!r} is not one of {', '.join(FORMATS)}")
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if format == "chat" and not has_template:
            raise ValueError(
                "episode.params.format='chat' but the tokenizer has no chat "
                "template; use format=bracket"
            )
        self.format = format if format != "auto" else ("chat" if has_template else "bracket")
        if "{result}" not in observation_template:
            raise ValueError(
                f"episode.params.observation_template={observation_template!r} has no {{result}}"
            )
        self.observation_template = observation_template
        if max_calls_per_turn < 1:
            raise ValueError(
                f"episode.params.max_calls_per_turn={max_calls_per_turn!r} must be >= 1"
            )
        self.max_calls_per_turn = max_calls_per_turn

    def stop_strings(self) -> list[str]:
        return [BRACKET_CLOSE] if self.format == "bracket" else []

    def tools(self) -> list[dict[str, Any]]:
        return [tool.definition() for tool in self._tools.values()] if self.format == "chat" else []

    async def start(self) -> None:
        for tool in self._tools.values():
            await tool.start()

    async def close(self) -> None:
        for tool in self._tools.values():
            await tool.close()

    async def step(self, episode: Episode) -> Observation | RewardOutcome:
        turn = episode.last
        calls = self._calls(turn)
        if not calls:
            return await asyncio.to_thread(self.task.reward, turn.text, episode.reference)
        if episode.is_last_turn:
            return Observation(text="")  # the turn limit ends the episode; nothing to run
        results = await asyncio.gather(*(self._run(call, i) for i, call in enumerate(calls)))
        text = await self._render(results)
        return Observation(
            text=text, num_tool_calls=len(calls), num_tool_errors=sum(r.failed for r in results)
        )

    def _calls(self, turn: Turn) -> list[ToolCall]:
        """The calls of a turn that ended where calls end: at the chat template's end of
        turn, the tokenizer's EOS (chat), or at `]` (bracket). Any other turn (cut by its
        token budget, or ended by another stop token) is an answer."""
        if self.format == "chat":
            ended = turn.token_ids[-1:] == [self.tokenizer.eos_token_id]
            return parse_chat_calls(turn.text) if ended else []
        first = next(iter(self._tools.values()))
        return parse_bracket_call(turn.text, first.name, first.argument) if turn.stopped else []

    async def _run(self, call: ToolCall, index: int) -> ToolResult:
        if call.error:
            return ToolResult(text=f"error: {call.error}", failed=True)
        if index >= self.max_calls_per_turn:
            return ToolResult(
                text=f"error: at most {self.max_calls_per_turn} tool calls per "
                "turn; this one was not run",
                failed=True,
            )
        tool = self._tools.get(call.name)
        if tool is None:
            return ToolResult(
                text=f"error: unknown tool {call.name!r}; the tools are {', '.join(self._tools)}",
                failed=True,
            )
        return await tool.call(call.arguments)

    async def _render(self, results: list[ToolResult]) -> str:
        if self.format == "bracket":
            return "".join(self.observation_template.replace("{result}", r.text) for r in results)
        return await asyncio.to_thread(
            chat_observation, self.tokenizer, [r.text for r in results], self.tokenizer.eos_token
        )
