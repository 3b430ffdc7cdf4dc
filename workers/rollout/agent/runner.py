"""Agent episodes of a rollout worker: the user's agent, run against this worker's endpoint.

    Generate (agent.function set) --> AgentRunner.run:
        a session and its API key (SessionRegistry) --> the agent, called with an
        openai.AsyncOpenAI(base_url=this worker's endpoint, api_key=the key) and the sample
        --> it returns a reward (or fails, or times out) --> the key is closed (401 from
        then on), calls still running are cancelled
    --> AgentEpisode: the session's segments, each a training sequence, with their rewards
        (areal.tasks.agent.segment_rewards) --> Generated

Failures are data, never a lost episode: an agent that raises, runs past agent.timeout_s
or returns an unusable reward ends its episode with reward 0 and verdict error / timeout
(EpisodeEnd.ERROR, then reward.on_error in the controller), keeping the segments sampled so
far. An agent that fails after one of its calls was refused for the token budget or the
call limit ends at that limit instead (reward 0, no answer): running out of budget is a
result, not a failure. An episode that made no call has nothing to train: an empty
completion of the Generate's prompt, ended in an error.

All agents of a worker share one HTTP connection pool (a client per episode would cost
~36 ms of CPU each to build); an agent closing its client (`async with client`) leaves the
pool open. Not here: HTTP (endpoint.py), token accounting (session.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx2
import numpy as np
import openai

from areal.config import RunConfig
from areal.messages import EpisodeEnd, Generated
from areal.tasks.agent import (
    AgentFunction,
    AgentSample,
    episode_rewards,
    load_agent,
    segment_rewards,
)
from areal.tasks.base import RewardOutcome, Task, Verdict
from areal.tasks.chat_render import ChatFormat
from areal.workers.rollout.agent.endpoint import Endpoint, EndpointServer, SessionRegistry
from areal.workers.rollout.agent.session import AgentSession, Sampling, Segment, SessionLimits
from areal.workers.rollout.engine import FinishReason, SamplingParams
from areal.workers.rollout.interruptible import InterruptibleGenerator

log = logging.getLogger(__name__)


class _SharedPool(openai.DefaultAsyncHttpxClient):
    """The worker's connection pool: `aclose` from an agent's client is ignored."""

    async def aclose(self) -> None:
        pass

    async def close_pool(self) -> None:
        await super().aclose()


@dataclass(kw_only=True)
class AgentEpisode:
    """A finished agent episode: its segments (in the order of their last calls) and how
    it ended."""

    segments: list[Segment] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    """One per segment."""
    end: EpisodeEnd = EpisodeEnd.AGENT
    outcome: RewardOutcome = field(
        default_factory=lambda: RewardOutcome(reward=0.0, verdict=Verdict.ERROR)
    )
    finish_reason: FinishReason = FinishReason.STOP
    num_calls: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    num_retries: int = 0
    num_interruptions: int = 0
    queue_s: float = 0.0
    decode_s: float = 0.0
    agent_s: float = 0.0
    """Wall seconds in which no call of the episode ran (the agent's own work)."""
    seconds: float = 0.0

    @property
    def num_model_tokens(self) -> int:
        return sum(sum(s.tokens.loss_mask) for s in self.segments)


class AgentRunner:
    """Runs agent episodes on one generator behind one endpoint (see the module doc)."""

    def __init__(
        self,
        *,
        generator: InterruptibleGenerator,
        chat: ChatFormat,
        agent: AgentFunction,
        cfg: RunConfig,
        server: EndpointServer,
        registry: SessionRegistry,
        context_len: int | None,
        task: Task | None = None,
    ) -> None:
        self.generator = generator
        self.task = task
        self.chat = chat
        self.agent = agent
        self.cfg = cfg
        self.server = server
        self.registry = registry
        self.context_len = context_len
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="agent-tokenizer")
        self._pool = _SharedPool(
            limits=httpx2.Limits(max_connections=None, max_keepalive_connections=1024),
            timeout=httpx2.Timeout(cfg.agent.timeout_s, connect=30.0),
        )

    async def _in_thread(self, fn, *args):
        # One thread: a fast tokenizer must not be used from two threads at once.
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def client(self, key: str) -> openai.AsyncOpenAI:
        """An OpenAI client whose every call is one of the episode of `key`."""
        return openai.AsyncOpenAI(
            api_key=key, base_url=self.server.base_url, http_client=self._pool, max_retries=2
        )

    def open_session(self, request_id: str, params: SamplingParams) -> AgentSession:
        return AgentSession(
            request_id=request_id,
            generator=self.generator,
            chat=self.chat,
            run_in_thread=self._in_thread,
            limits=SessionLimits(
                max_new_tokens=params.max_new_tokens,
                context_len=self.context_len,
                max_calls=self.cfg.agent.max_calls,
            ),
            sampling=Sampling(
                temperature=params.temperature,
                top_p=params.top_p,
                stop_token_ids=tuple(params.stop_token_ids),
                request_sampling=self.cfg.agent.request_sampling,
            ),
        )

    async def run(
        self,
        request_id: str,
        params: SamplingParams,
        *,
        prompt_id: str,
        prompt_text: str,
        reference: Any,
    ) -> AgentEpisode:
        """One episode: the agent on this sample, until it returns (module doc)."""
        session = self.open_session(request_id, params)
        key = self.registry.open(session)
        sample = AgentSample(
            prompt_id=prompt_id,
            prompt=prompt_text,
            reference=reference,
            params=dict(self.cfg.agent.params),
            task=self.task,
        )
        start = time.monotonic()
        returned: Any = None
        failure: tuple[Verdict, str] | None = None
        timeout = self.cfg.agent.timeout_s
        try:
            async with asyncio.timeout(timeout):
                returned = await self.agent(self.client(key), sample)
        except TimeoutError:
            failure = Verdict.TIMEOUT, f"the agent did not finish within agent.timeout_s={timeout}"
        except Exception as err:  # fault boundary: a failing agent ends its episode, kept
            log.warning("agent failed in episode %s: %r", prompt_id, err)
            failure = Verdict.ERROR, f"the agent raised {type(err).__name__}: {err}"
        finally:
            self.registry.close(key)
            await session.close()
        return self._episode(session, returned, failure, time.monotonic() - start)

    def _episode(
        self,
        session: AgentSession,
        returned: Any,
        failure: tuple[Verdict, str] | None,
        seconds: float,
    ) -> AgentEpisode:
        episode = AgentEpisode(
            num_calls=len(session.calls),
            num_tool_calls=session.num_tool_calls,
            num_tool_errors=session.num_tool_errors,
            num_retries=session.num_retries,
            num_interruptions=session.num_interruptions,
            queue_s=session.queue_s,
            decode_s=session.decode_s,
            agent_s=max(0.0, seconds - session.call_s),
            seconds=seconds,
        )
        completion_ids = [cid for cid, _ in session.calls]
        if failure is None:
            try:
                per_call, outcome = episode_rewards(returned, completion_ids)
            except (TypeError, ValueError) as err:
                failure = Verdict.ERROR, str(err)
        if failure is not None:
            per_call = [0.0] * len(completion_ids)
            if session.limit is not None:
                episode.end = session.limit
                outcome = RewardOutcome(
                    reward=0.0,
                    verdict=Verdict.NO_ANSWER,
                    detail=f"the episode ended at its {session.limit.value} ({failure[1]})",
                )
            else:
                episode.end = EpisodeEnd.ERROR
                outcome = RewardOutcome(reward=0.0, verdict=failure[0], detail=failure[1])
        # Segments ordered by their last call, so that the last holds the episode's last call.
        last_call = {segment: k for k, (_, segment) in enumerate(session.calls)}
        order = sorted(last_call, key=lambda segment: last_call[segment])
        position = {segment: i for i, segment in enumerate(order)}
        episode.segments = [session.segments[s] for s in order]
        episode.rewards = segment_rewards(
            [position[s] for _, s in session.calls], per_call, self.cfg.agent.discount, len(order)
        )
        episode.outcome = outcome
        if episode.end in (EpisodeEnd.TOKEN_LIMIT, EpisodeEnd.TURN_LIMIT):
            episode.finish_reason = FinishReason.LENGTH
        return episode

    async def close(self) -> None:
        await self.server.close()
        await self._pool.close_pool()
        self._tokenizer_thread.shutdown(wait=False)
        owner_close = getattr(getattr(self.agent, "__self__", None), "close", None)
        if owner_close is not None:  # a class agent's resources (a sandbox launcher)
            await owner_close()


def generated_agent_episode(
    request_id: str, episode: AgentEpisode, prompt_ids: np.ndarray
) -> Generated:
    """The Generated message of a finished agent episode; with no segment (no call), an
    empty completion of the Generate's `prompt_ids`."""
    segments = episode.segments
    arrays: dict[str, Any] = {
        name: np.concatenate([np.asarray(getattr(s.tokens, attr), dtype) for s in segments])
        if segments
        else np.zeros(0, dtype)
        for name, attr, dtype in (
            ("output_ids", "token_ids", np.int32),
            ("logprobs", "logprobs", np.float32),
            ("versions", "versions", np.int32),
            ("loss_mask", "loss_mask", bool),
        )
    }
    prompts = (
        np.concatenate([np.asarray(s.prompt_ids, np.int32) for s in segments]) if segments else None
    )
    outcome = episode.outcome
    return Generated(
        request_id=request_id,
        **arrays,
        prompt_ids=prompts,
        segment_prompt_lens=[len(s.prompt_ids) for s in segments],
        segment_output_lens=[len(s.tokens.token_ids) for s in segments],
        segment_rewards=[float(r) for r in episode.rewards] if segments else [],
        finish_reason=episode.finish_reason,
        num_interruptions=episode.num_interruptions,
        generation_s=episode.seconds,
        episode_end=episode.end,
        reward=float(episode.rewards[-1]) if segments else float(outcome.reward),
        verdict=outcome.verdict,
        detail=outcome.detail[:2000],
        num_turns=episode.num_calls,
        num_tool_calls=episode.num_tool_calls,
        num_tool_errors=episode.num_tool_errors,
        tool_s=episode.agent_s,
        num_retries=episode.num_retries,
        queue_s=episode.queue_s,
        decode_s=episode.decode_s,
    )


async def start_agents(
    cfg: RunConfig, generator: InterruptibleGenerator, *, rank: int, context_len: int | None
) -> AgentRunner | None:
    """The agent runner of a rollout worker when `agent.function` is set (its endpoint
    listening), else None."""
    if cfg.agent.function is None:
        return None
    from areal.models.tokenizer import load_tokenizer
    from areal.tasks import load_task

    function, model = cfg.agent.function, cfg.model.tokenizer_dir()

    def build() -> tuple[ChatFormat, AgentFunction, Task]:
        tokenizer = load_tokenizer(
            model, trust_remote_code=cfg.model.trust_remote_code, cache_dir=cfg.cache_dir
        )
        chat = ChatFormat(
            tokenizer,
            format=cfg.agent.tool_format,
            observation_template=cfg.agent.observation_template,
            template_kwargs=cfg.agent.chat_template_kwargs,
        )
        task = load_task(cfg.task.name, cfg.task.params)
        task.use_tokenizer(tokenizer)
        return chat, load_agent(function, cfg.agent.params), task

    chat, agent, task = await asyncio.to_thread(build)
    registry = SessionRegistry()
    endpoint = Endpoint(
        registry,
        model_name=cfg.agent.model_name,
        max_request_bytes=cfg.agent.max_request_bytes,
        max_request_tokens=cfg.agent.max_request_tokens,
    )
    server = EndpointServer(
        endpoint, cfg.agent.host, cfg.agent.port + rank if cfg.agent.port else 0
    )
    await server.start()
    return AgentRunner(
        generator=generator,
        chat=chat,
        agent=agent,
        cfg=cfg,
        server=server,
        registry=registry,
        context_len=context_len,
        task=task,
    )
