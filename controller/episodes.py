"""What the controller does differently for multi-turn episodes (episode.environment set).

- `episode_fields`: a Generate also carries the prompt's id and reference, which the
  rollout worker's environment rewards against;
- `rollout_outcome`: a finished episode arrives with its reward (Generated.reward/verdict),
  so it is recorded as scored at once instead of going to a reward worker (as is a single
  completion when the run has no reward workers, reward.num_workers=0: its rollout worker
  scored it);
- `episode_metrics`: the `episode/` (step records) or `eval/` (evaluations) metrics of a
  set of trajectories: turns, tool calls, tool errors and time, model vs observation tokens,
  how episodes ended; for agent episodes also calls and segments per episode, retries
  coalesced, endpoint seconds per call queueing vs decoding. Empty when no trajectory is an
  episode.

Everything else treats an episode as one trajectory (admission, staleness, packing, resume).
"""

from __future__ import annotations

import collections
import math
from typing import Any
from collections.abc import Sequence

import numpy as np

from areal.config import RunConfig
from areal.messages import Generated
from areal.tasks.base import Prompt, RewardOutcome, Verdict
from areal.types import Trajectory


def episode_fields(cfg: RunConfig, prompt: Prompt) -> dict[str, Any]:
    """Extra Generate fields: the prompt id and reference when episodes run or the rollout
    workers score (reward.num_workers=0), and the prompt text for an agent, which renders
    its own messages; else none."""
    if cfg.agent.function is not None:
        return {
            "prompt_id": prompt.prompt_id,
            "reference": prompt.reference,
            "prompt_text": prompt.text,
        }
    if cfg.episode.environment is None and cfg.reward.num_workers > 0:
        return {}
    return {"prompt_id": prompt.prompt_id, "reference": prompt.reference}


def rollout_outcome(msg: Generated) -> RewardOutcome:
    """The outcome its rollout worker found for `msg`: an episode's, from its environment,
    or a single completion's, from the task's reward function (reward.num_workers=0)."""
    return outcome_of(msg.reward, msg.verdict, msg.detail)


def outcome_of(reward: float, verdict: Verdict | None, detail: str) -> RewardOutcome:
    """A rollout worker's reward, verdict and detail as an outcome; one that breaks the
    schema's contract (no verdict, a reward that is not a finite number) is an
    infrastructure failure (ERROR) saying so."""
    if verdict is None:  # a worker that does not follow the schema's contract
        return RewardOutcome(
            reward=0.0,
            verdict=Verdict.ERROR,
            detail="the completion arrived from its rollout worker without a verdict",
        )
    if not math.isfinite(reward):
        return RewardOutcome(
            reward=0.0,
            verdict=Verdict.ERROR,
            detail=f"the rollout worker's reward {reward!r} is not a finite number",
        )
    return RewardOutcome(reward=reward, verdict=verdict, detail=detail)


def episode_metrics(trajectories: Sequence[Trajectory], prefix: str) -> dict[str, Any]:
    """Per-episode means and totals under `prefix` ('episode/' or 'eval/')."""
    episodes = [t for t in trajectories if t.episode]
    if not episodes:
        return {}
    turns = np.array([t.episode["turns"] for t in episodes])
    calls = np.array([t.episode["tool_calls"] for t in episodes])
    errors = int(sum(t.episode["tool_errors"] for t in episodes))
    # An agent episode's counts cover all its segments (its last carries them).
    model = np.array([t.episode.get("model_tokens", t.num_model_tokens) for t in episodes])
    observed = np.array(
        [
            t.episode.get(
                "observation_tokens", t.num_tokens - t.num_prompt_tokens - t.num_model_tokens
            )
            for t in episodes
        ]
    )
    ends = collections.Counter(t.episode["end"] for t in episodes)
    return {
        **_agent_metrics(episodes, prefix),
        f"{prefix}turns_mean": float(turns.mean()),
        f"{prefix}turns_max": int(turns.max()),
        f"{prefix}tool_calls_mean": float(calls.mean()),
        f"{prefix}tool_use_fraction": float((calls > 0).mean()),
        f"{prefix}tool_errors": errors,
        f"{prefix}tool_error_rate": errors / int(calls.sum()) if calls.sum() else 0.0,
        f"{prefix}tool_s_mean": float(np.mean([t.episode["tool_s"] for t in episodes])),
        f"{prefix}model_tokens_mean": float(model.mean()),
        f"{prefix}observation_tokens_mean": float(observed.mean()),
        f"{prefix}ends": dict(sorted(ends.items())),
    }


def _agent_metrics(episodes: Sequence[Trajectory], prefix: str) -> dict[str, Any]:
    """Agent episodes (agent.function): chat calls and training segments per episode, SDK
    retries answered without sampling again, and the endpoint's seconds per call before
    the engine (queue: rendering, tokenizing, waiting for new weights) and in it (decode)."""
    agents = [t.episode for t in episodes if t.episode.get("agent")]
    if not agents:
        return {}
    num_calls = sum(e["turns"] for e in agents)
    return {
        f"{prefix}calls_mean": num_calls / len(agents),
        f"{prefix}segments_mean": float(np.mean([e["segments"] for e in agents])),
        f"{prefix}split_fraction": float(np.mean([e["segments"] > 1 for e in agents])),
        f"{prefix}retries_coalesced": int(sum(e["retries"] for e in agents)),
        f"{prefix}endpoint_queue_s_mean": sum(e["queue_s"] for e in agents) / max(num_calls, 1),
        f"{prefix}endpoint_decode_s_mean": sum(e["decode_s"] for e in agents) / max(num_calls, 1),
    }
