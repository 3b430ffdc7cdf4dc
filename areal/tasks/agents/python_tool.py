"""A math agent with a Python tool: plain `openai` client code, the program run in
`areal.sandbox` (examples/gsm8k_qwen2.5_1.5b_agent_vllm.yaml).

    system + user question --chat--> python(code=...) tool calls, run in the sandbox, their
    output sent back as tool messages --chat--> ... --> the answer (\\boxed{}), scored by
    the run's task (math-verify for gsm8k)

A class agent (agent.function: areal.tasks.agents.python_tool:PythonAgent), built once per
rollout worker with agent.params: the sandbox launcher is started by the first episode and
shared by all of them; `close` stops it when the worker stops.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from areal.tasks.agent import AgentSample
from areal.tasks.base import RewardOutcome
from areal.tasks.tools import PythonTool

SYSTEM_PROMPT = (
    "You are a careful math assistant. You can run Python with the python tool "
    "to check a computation; print what you need to see. Put your final answer "
    "within \\boxed{}."
)


class PythonAgent:
    def __init__(
        self,
        *,
        system_prompt: str = SYSTEM_PROMPT,
        max_calls: int = 4,
        max_tokens: int = 1024,
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
        max_output_chars: int = 1000,
        max_concurrency: int = 32,
    ) -> None:
        """max_calls: chat calls per question (the last one answers); max_tokens: per call;
        the rest configure the sandboxed python tool (areal.tasks.tools.PythonTool)."""
        self.system_prompt, self.max_calls, self.max_tokens = system_prompt, max_calls, max_tokens
        self.tool = PythonTool(
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            max_output_chars=max_output_chars,
            max_concurrency=max_concurrency,
        )
        self._started: asyncio.Future | None = None

    async def run(self, client: Any, sample: AgentSample) -> RewardOutcome:
        if self._started is None:
            self._started = asyncio.ensure_future(self.tool.start())
        await self._started
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": sample.prompt},
        ]
        answer = ""
        for _ in range(self.max_calls):
            completion = await client.chat.completions.create(
                model="policy",
                messages=messages,
                tools=[self.tool.definition()],
                max_tokens=self.max_tokens,
            )
            message = completion.choices[0].message
            answer = message.content or ""
            if not message.tool_calls:
                break
            messages.append(message.model_dump(exclude_none=True))
            results = await asyncio.gather(
                *(self._call(c.function.arguments) for c in message.tool_calls)
            )
            messages += [
                {"role": "tool", "tool_call_id": call.id, "content": text}
                for call, text in zip(message.tool_calls, results, strict=True)
            ]
        return await sample.score(answer)

    async def _call(self, arguments: str) -> str:
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return f"error: the arguments are not JSON: {arguments[:60]!r}"
        if not isinstance(parsed, dict):
            return "error: the arguments must be an object"
        return (await self.tool.call(parsed)).text

    async def close(self) -> None:
        await self.tool.close()
