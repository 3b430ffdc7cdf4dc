"""Agents: the user's own code against the OpenAI API, trained through the rollout endpoint.

An agent is `async def run(client, sample) -> reward`, named in the config as
`agent.function: 'package.module:function'` (or a class with that method, built once per
rollout worker with `agent.params`; its `async def close()`, if any, runs when the worker
stops). For each sample the rollout worker calls it with an
`openai.AsyncOpenAI` whose base URL and API key route every chat call of this episode to
this episode (areal.workers.rollout.agent); `sample` is an `AgentSample`. It returns

- a number: the reward of the episode, credited to its last chat call (verdict ok when it
  is > 0, else wrong);
- a `RewardOutcome` (areal.tasks.base): the same with its own verdict and detail (e.g. the
  task's `reward(answer, reference)`), which held-out pass@1 counts;
- a mapping {completion id: reward} (`ChatCompletion.id` of its calls): each call's own
  reward; calls not named get 0 (verdict ok when the sum is > 0).

Rewards propagate back through earlier calls (`agent.discount`, gamma): a call's return is
G_k = r_k + gamma * G_{k+1}, calls in the order they finished. Calls whose messages extend
each other form one training segment (one sequence); a segment is trained with the return
of its last call plus the rewards of its earlier calls (`segment_rewards`). With gamma 1
and one segment that is the sum of the rewards.

This module runs no agent and no server; it defines what an agent is and how its rewards
become the rewards of training sequences.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Awaitable, Callable, Mapping, Sequence

from areal.tasks.base import RewardOutcome, Task, Verdict

AgentFunction = Callable[[Any, "AgentSample"], Awaitable[Any]]


@dataclass(frozen=True, kw_only=True)
class AgentSample:
    """What an agent is asked to do: one prompt of the run's task."""

    prompt_id: str
    prompt: str
    """The task's prompt text (the agent puts it in its own messages)."""
    reference: Any
    """The task's reference for this prompt (plain data), for the agent's reward."""
    params: dict[str, Any] = field(default_factory=dict)
    """agent.params of the run."""
    task: Task | None = None
    """The run's task (task.name), for `score`."""

    async def score(self, answer: str) -> RewardOutcome:
        """The run's task's reward of `answer` against this sample's reference (in a thread:
        checkers may block), e.g. `return await sample.score(final_message.content)`."""
        if self.task is None:
            raise RuntimeError("this sample has no task to score with")
        return await asyncio.to_thread(self.task.reward, answer, self.reference)


def load_agent(path: str, params: dict[str, Any] | None = None) -> AgentFunction:
    """The agent named by 'package.module:function' or 'package.module:Class' (an instance
    built with `params`, its `run` method). ValueError naming the path when it is neither."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"agent.function={path!r} is not an import path 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"agent.function={path!r}: cannot import module {module_name!r}: {err}"
        ) from err
    target = getattr(module, attr, None)
    if target is None:
        raise ValueError(f"agent.function={path!r}: module {module_name!r} has no {attr!r}")
    if isinstance(target, type):
        try:
            target = target(**(params or {})).run
        except TypeError as err:
            raise ValueError(f"agent.params do not fit {target.__name__}: {err}") from err
        except AttributeError:
            raise ValueError(f"agent.function={path!r}: class {attr} has no run method") from None
    if not inspect.iscoroutinefunction(target):
        raise ValueError(
            f"agent.function={path!r} is not an async function (async def "
            "run(client, sample)) nor a class with one"
        )
    return target


def episode_rewards(
    returned: Any, completion_ids: Sequence[str]
) -> tuple[list[float], RewardOutcome]:
    """(reward of each call, in `completion_ids` order; the episode's outcome) of what an
    agent returned. ValueError / TypeError, with the reason, when it cannot be used."""
    if not completion_ids:
        raise ValueError(
            "the agent made no chat call through its client: there is nothing to train"
        )
    rewards = [0.0] * len(completion_ids)
    if isinstance(returned, RewardOutcome):
        rewards[-1] = _finite(returned.reward, "the returned RewardOutcome's reward")
        return rewards, returned
    if isinstance(returned, numbers.Real) and not isinstance(returned, bool):
        rewards[-1] = _finite(returned, "the returned reward")
        return rewards, _outcome(rewards[-1])
    if isinstance(returned, Mapping):
        index = {cid: i for i, cid in enumerate(completion_ids)}
        for cid, value in returned.items():
            if cid not in index:
                raise ValueError(
                    f"the agent returned a reward for completion {cid!r}, which "
                    "is not one of this episode's calls"
                )
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(
                    f"the reward of completion {cid!r} is a {type(value).__name__}, not a number"
                )
            rewards[index[cid]] = _finite(value, f"the reward of completion {cid!r}")
        return rewards, _outcome(sum(rewards))
    raise TypeError(
        f"the agent returned a {type(returned).__name__}; return a number, a "
        "RewardOutcome or {completion id: reward}"
    )


def _finite(value: numbers.Real | float, what: str) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{what} {value!r} is not a finite number")
    return value


def _outcome(reward: float) -> RewardOutcome:
    return RewardOutcome(reward=reward, verdict=Verdict.OK if reward > 0 else Verdict.WRONG)


def call_returns(rewards: Sequence[float], discount: float) -> list[float]:
    """G_k = r_k + discount * G_{k+1} of each call (calls in the order they finished)."""
    returns = [0.0] * len(rewards)
    following = 0.0
    for k in range(len(rewards) - 1, -1, -1):
        following = returns[k] = rewards[k] + discount * following
    return returns


def segment_rewards(
    call_segments: Sequence[int], rewards: Sequence[float], discount: float, num_segments: int
) -> list[float]:
    """The reward of each segment: the return of its last call plus the rewards of its
    earlier calls. `call_segments[k]` is the segment of call k (calls in finishing order)."""
    returns = call_returns(rewards, discount)
    last: dict[int, int] = {}
    for k, segment in enumerate(call_segments):
        last[segment] = k
    out = [0.0] * num_segments
    for k, segment in enumerate(call_segments):
        out[segment] += returns[k] if last[segment] == k else rewards[k]
    return out


__all__ = [
    "AgentFunction",
    "AgentSample",
    "call_returns",
    "episode_rewards",
    "load_agent",
    "segment_rewards",
]
