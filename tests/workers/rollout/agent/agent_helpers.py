"""Helpers of the agent-endpoint tests: a scripted engine (the code around the engine is what
these tests check; the interruption test runs the real torch engine), a runner on it with a
real endpoint, and token helpers for the Qwen2.5-style tokenizer.

`ScriptedEngine` honours the engine contract where the code under test can see it: it
stops at the first stop token or the token budget, reports a log-prob per token, and
`hold` keeps every call inside the engine until released (or, with `barrier=n`, until n
calls are inside at once).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

from areal.config import load_config
from areal.tasks.chat_render import ChatFormat
from areal.workers.rollout.agent.endpoint import Endpoint, EndpointServer, SessionRegistry
from areal.workers.rollout.agent.runner import AgentRunner
from areal.workers.rollout.engine import (
    Engine,
    EngineOutput,
    EngineState,
    FinishReason,
    SamplingParams,
)
from areal.workers.rollout.interruptible import InterruptibleGenerator

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "areal" / "tasks"))
from qwen_style import build_qwen_style_tokenizer

LOGPROB = -0.25


class ScriptedEngine(Engine):
    """Answers call i with `replies[i]` (or `replies(prompt)`), cut at a stop token or the
    budget; every token's log-prob is LOGPROB. Records each call's prompt."""

    def __init__(
        self,
        replies: Sequence[list[int]] | Callable[[list[int]], list[int]],
        *,
        barrier: int | None = None,
    ) -> None:
        self.replies = replies
        self.prompts: list[list[int]] = []
        self.released = asyncio.Event()
        self.released.set()
        self.barrier = barrier
        self.inside = 0
        self._state = EngineState.CREATED

    def hold(self) -> None:
        self.released.clear()

    @property
    def state(self) -> EngineState:
        return self._state

    async def start(self) -> None:
        self._state = EngineState.RUNNING

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> EngineOutput:
        prompt = list(prompt_ids)
        index = len(self.prompts)
        self.prompts.append(prompt)
        reply = self.replies(prompt) if callable(self.replies) else self.replies[index]
        self.inside += 1
        try:
            if self.barrier is not None and self.inside >= self.barrier:
                self.released.set()
            await self.released.wait()
        finally:
            self.inside -= 1
        tokens, reason = [], FinishReason.LENGTH
        for token in reply[: params.max_new_tokens]:
            tokens.append(token)
            if token in params.stop_token_ids:
                reason = FinishReason.STOP
                break
        return EngineOutput(
            token_ids=tokens, logprobs=[LOGPROB] * len(tokens), finish_reason=reason
        )

    async def pause(self) -> None:
        self._state = EngineState.PAUSED

    async def update_weights(self, source: Any) -> None:
        pass

    async def resume(self) -> None:
        self._state = EngineState.RUNNING

    async def close(self) -> None:
        self._state = EngineState.CLOSED


def qwen_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def char_ids(tokenizer: Any, text: str) -> list[int]:
    """`text` one character per token, as a model may sample it (never merged into the added
    tokens such as <tool_call> that tokenizing the text gives)."""
    return [qwen_ids(tokenizer, ch)[0] for ch in text]


class AgentCheckFailed(BaseException):
    """An assertion inside a test's agent: a BaseException, so that it passes the runner's
    fault boundary (which turns an agent's Exception into a failed episode) and fails the
    test."""


def checked(agent):
    async def run(client, sample):
        try:
            return await agent(client, sample)
        except AssertionError as err:
            raise AgentCheckFailed(f"inside the agent: {err!r}") from err

    return run


async def make_runner(
    engine: Engine,
    agent,
    *,
    tokenizer: Any | None = None,
    max_new_tokens: int = 400,
    context_len: int | None = 4096,
    overrides: Sequence[str] = (),
    temperature: float = 1.0,
) -> tuple[AgentRunner, Any]:
    """A started AgentRunner (real endpoint on a free loopback port) over `engine`, for
    `agent` (an async function; an assertion failing inside it fails the test). Returns
    (runner, SamplingParams of its episodes)."""
    tokenizer = tokenizer or build_qwen_style_tokenizer()
    cfg = load_config(overrides=["agent.function=tests.placeholder:run", *overrides])
    if engine.state is EngineState.CREATED:
        await engine.start()
    chat = ChatFormat(
        tokenizer, format=cfg.agent.tool_format, observation_template=cfg.agent.observation_template
    )
    registry = SessionRegistry()
    endpoint = Endpoint(
        registry,
        model_name=cfg.agent.model_name,
        max_request_bytes=cfg.agent.max_request_bytes,
        max_request_tokens=cfg.agent.max_request_tokens,
    )
    server = EndpointServer(endpoint, "127.0.0.1", 0)
    await server.start()
    runner = AgentRunner(
        generator=InterruptibleGenerator(engine),
        chat=chat,
        agent=checked(agent),
        cfg=cfg,
        server=server,
        registry=registry,
        context_len=context_len,
    )
    eos = [tokenizer.eos_token_id]
    params = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=eos
    )
    return runner, params


CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
