"""The episode loop of a rollout worker: model turns and observations in one trajectory.

    prompt --> turn: InterruptibleGenerator.generate(prompt + everything so far) --> model
               tokens (their version, behaviour log-prob, loss mask True)
           --> Environment.step(episode) --> RewardOutcome: the episode ends
                                         --> Observation: tokenized and appended (version -1,
                                             log-prob 0, loss mask False) --> next turn

Each turn is one `generate` call, so a weight update in the middle of any turn interrupts
it like a single completion: the turn is resubmitted as prompt + everything so far and
goes on under the new weights, tokens keeping the version that sampled them; the
observation tokens in that context are recomputed like the prompt's. A turn that starts
while an update is pending waits for it (the generator's gate).

Limits: `episode.max_turns` model turns (TURN_LIMIT when the environment still answers
with an observation after the last one), `rollout.max_new_tokens` tokens after the prompt,
model and observation tokens together (TOKEN_LIMIT when it is used up or the next
observation does not fit), `episode.max_turn_tokens` per turn. A limit ends the episode
with reward 0 and verdict no_answer. An environment that raises or exceeds
`episode.step_timeout_s` ends it with reward 0 and verdict error / timeout (EpisodeEnd.
ERROR): the episode is reported, never lost.

Tokenizing observations and decoding turns run on one tokenizer thread, off the event loop.
Not here: the environment (areal.tasks.environment), transport, interruption itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

import numpy as np

from areal.config import RunConfig
from areal.messages import EpisodeEnd, Generated
from areal.seeds import continuation_seed
from areal.tasks.base import RewardOutcome, Verdict
from areal.tasks.environment import Environment, Episode, Observation, Turn, TurnRole
from areal.types import PROMPT_VERSION
from areal.workers.rollout.engine import FinishReason, SamplingParams
from areal.workers.rollout.interruptible import InterruptibleGenerator

log = logging.getLogger(__name__)

OBSERVATION_LOGPROB = 0.0
"""Behaviour log-prob stored for observation tokens (no policy sampled them; never used:
their loss mask is False). Their version is PROMPT_VERSION (-1), as for prompt tokens."""


@dataclass(frozen=True, kw_only=True)
class EpisodeLimits:
    max_turns: int
    max_turn_tokens: int | None = None
    step_timeout_s: float = 60.0


@dataclass(kw_only=True)
class EpisodeResult:
    """A finished episode. Per-token lists have length T (everything after the prompt)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    end: EpisodeEnd = EpisodeEnd.ENVIRONMENT
    outcome: RewardOutcome = RewardOutcome(reward=0.0, verdict=Verdict.NO_ANSWER)  # noqa: RUF009 (frozen)
    finish_reason: FinishReason = FinishReason.STOP
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    tool_s: float = 0.0
    num_interruptions: int = 0

    def append(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float] | None,
        versions: Sequence[int] | None,
    ) -> None:
        """Model tokens (with log-probs and versions) or, with None, observation tokens."""
        if logprobs is not None and versions is not None:
            self.logprobs += logprobs
            self.versions += versions
        elif logprobs is None and versions is None:
            self.logprobs += [OBSERVATION_LOGPROB] * len(token_ids)
            self.versions += [PROMPT_VERSION] * len(token_ids)
        else:
            raise ValueError(
                "model tokens come with their log-probs and versions, observation tokens "
                f"with neither (logprobs {logprobs is not None}, versions {versions is not None})"
            )
        self.token_ids += token_ids
        self.loss_mask += [logprobs is not None] * len(token_ids)


class EpisodeRunner:
    """Runs episodes of one environment on one generator (see the module docstring)."""

    def __init__(
        self,
        generator: InterruptibleGenerator,
        environment: Environment,
        tokenizer: Any,
        limits: EpisodeLimits,
    ) -> None:
        self.generator = generator
        self.environment = environment
        self.tokenizer = tokenizer
        self.limits = limits
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="episode-tokenizer")

    async def _tokenizer_call(self, fn, *args, **kwargs):
        # One thread: a fast tokenizer must not be used from two threads at once.
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_thread, lambda: fn(*args, **kwargs)
        )

    async def run(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt_id: str = "",
        reference: Any = None,
    ) -> EpisodeResult:
        """One episode from `prompt_ids`; `params.max_new_tokens` is its token budget."""
        prompt = [int(t) for t in prompt_ids]
        result = EpisodeResult()
        episode = Episode(
            prompt_id=prompt_id,
            reference=reference,
            max_turns=self.limits.max_turns,
            prompt=await self._tokenizer_call(self.tokenizer.decode, prompt),
        )
        while True:
            budget = params.max_new_tokens - len(result.token_ids)
            if self.limits.max_turn_tokens is not None:
                budget = min(budget, self.limits.max_turn_tokens)
            if budget < 1:
                return self._limit(
                    result,
                    EpisodeEnd.TOKEN_LIMIT,
                    f"its token budget (rollout.max_new_tokens={params.max_new_tokens}) ran out",
                )
            turn = await self.generator.generate(
                f"{request_id}/t{result.num_turns}",
                prompt + result.token_ids,
                dataclasses.replace(
                    params,
                    max_new_tokens=budget,
                    seed=None
                    if params.seed is None
                    else continuation_seed(params.seed, len(result.token_ids)),
                ),
            )
            result.append(turn.token_ids, turn.logprobs, turn.versions)
            result.num_turns += 1
            result.num_interruptions += turn.num_interruptions
            result.finish_reason = turn.finish_reason
            episode.turns.append(
                Turn(
                    role=TurnRole.MODEL,
                    token_ids=turn.token_ids,
                    text=await self._tokenizer_call(
                        self.tokenizer.decode, turn.token_ids, skip_special_tokens=True
                    ),
                    stopped=turn.finish_reason is FinishReason.STOP,
                )
            )
            answer = await self._step(episode, result)
            if not isinstance(answer, Observation):
                result.outcome = answer
                return result
            result.num_tool_calls += answer.num_tool_calls
            result.num_tool_errors += answer.num_tool_errors
            if result.num_turns >= self.limits.max_turns:
                return self._limit(
                    result,
                    EpisodeEnd.TURN_LIMIT,
                    f"the turn limit (episode.max_turns={self.limits.max_turns})",
                )
            observed = await self._tokenizer_call(self._encode, answer.text)
            if len(result.token_ids) + len(observed) >= params.max_new_tokens:
                return self._limit(
                    result,
                    EpisodeEnd.TOKEN_LIMIT,
                    f"an observation of "
                    f"{len(observed)} tokens that does not fit its token budget "
                    f"(rollout.max_new_tokens={params.max_new_tokens})",
                )
            result.append(observed, None, None)
            episode.turns.append(
                Turn(role=TurnRole.OBSERVATION, text=answer.text, token_ids=observed)
            )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    async def _step(self, episode: Episode, result: EpisodeResult) -> Observation | RewardOutcome:
        """The environment's answer; if it failed, the outcome that ends the episode (ERROR)."""
        start = time.monotonic()
        timeout = self.limits.step_timeout_s
        try:
            async with asyncio.timeout(timeout):
                answer = await self.environment.step(episode)
        except TimeoutError:
            return self._failed(
                result,
                Verdict.TIMEOUT,
                f"the environment did not answer turn "
                f"{result.num_turns} within episode.step_timeout_s={timeout}",
            )
        except Exception as err:  # fault boundary: a failing environment ends its episode
            log.warning("environment failed in episode %s: %r", episode.prompt_id, err)
            return self._failed(result, Verdict.ERROR, f"the environment raised {err!r}")
        finally:
            result.tool_s += time.monotonic() - start
        if not isinstance(answer, (Observation, RewardOutcome)):
            return self._failed(
                result,
                Verdict.ERROR,
                f"the environment returned a "
                f"{type(answer).__name__}, not an Observation or RewardOutcome",
            )
        return answer

    @staticmethod
    def _failed(result: EpisodeResult, verdict: Verdict, detail: str) -> RewardOutcome:
        result.end = EpisodeEnd.ERROR
        return RewardOutcome(reward=0.0, verdict=verdict, detail=detail)

    @staticmethod
    def _limit(result: EpisodeResult, end: EpisodeEnd, what: str) -> EpisodeResult:
        result.end, result.finish_reason = end, FinishReason.LENGTH
        result.outcome = RewardOutcome(
            reward=0.0, verdict=Verdict.NO_ANSWER, detail=f"the episode ended at {what}"
        )
        return result

    async def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False)
        await self.environment.close()


async def start_episodes(cfg: RunConfig, generator: InterruptibleGenerator) -> EpisodeRunner | None:
    """The episode runner of a process when `episode.environment` is set (its environment
    built and started, with the run's task and tokenizer), else None."""
    environment_name = cfg.episode.environment
    if environment_name is None:
        return None
    from areal.models.tokenizer import load_tokenizer
    from areal.tasks import load_task
    from areal.tasks.environment import load_environment

    def build() -> tuple[Environment, Any]:
        tokenizer = load_tokenizer(
            cfg.model.tokenizer_dir(),
            trust_remote_code=cfg.model.trust_remote_code,
            cache_dir=cfg.cache_dir,
        )
        task = load_task(cfg.task.name, cfg.task.params)
        task.use_tokenizer(tokenizer)
        return load_environment(
            environment_name, cfg.episode.params, task=task, tokenizer=tokenizer
        ), tokenizer

    environment, tokenizer = await asyncio.to_thread(build)
    await environment.start()
    limits = EpisodeLimits(
        max_turns=cfg.episode.max_turns,
        max_turn_tokens=cfg.episode.max_turn_tokens,
        step_timeout_s=cfg.episode.step_timeout_s,
    )
    return EpisodeRunner(generator, environment, tokenizer, limits)


def generated_episode(request_id: str, episode: EpisodeResult, seconds: float) -> Generated:
    """The Generated message of a finished episode."""
    return Generated(
        request_id=request_id,
        output_ids=np.asarray(episode.token_ids, np.int32),
        logprobs=np.asarray(episode.logprobs, np.float32),
        versions=np.asarray(episode.versions, np.int32),
        loss_mask=np.asarray(episode.loss_mask, bool),
        finish_reason=episode.finish_reason,
        num_interruptions=episode.num_interruptions,
        generation_s=seconds,
        episode_end=episode.end,
        reward=float(episode.outcome.reward),
        verdict=episode.outcome.verdict,
        detail=episode.outcome.detail[:2000],
        num_turns=episode.num_turns,
        num_tool_calls=episode.num_tool_calls,
        num_tool_errors=episode.num_tool_errors,
        tool_s=episode.tool_s,
    )
