"""The simulated workload: prompts of realistic lengths, and how long each completion runs.

`SimSetup` stands in for `areal.controller.setup.prepare_run`'s result where no model or
tokenizer exists: the controller draws prompts from it exactly as from a real task, and
gets token arrays of the sampled lengths (zeros, except the first token, which carries the
prompt's key so that every rollout server derives the same completion lengths for it).

Lengths (parameters in costs.yaml `workload`, each with its source):
    prompt tokens      log-normal(median, sigma), capped at prompt_max_tokens
    completion tokens  log-normal: log L = log(median) + sigma_prompt * z_prompt
                                            + sigma_sample * z_sample, capped at the run's
                       max_new_tokens (a capped completion ends by length, others by a stop
                       token); z_prompt is shared by the samples of one prompt (a hard
                       prompt makes every sample long)
Every draw is a function of (seed, prompt key, sample): the same in sync and async runs and
whichever server generates it, and again in a request re-queued after a worker loss.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import numpy as np

from areal.config import RunConfig, config_to_dict
from areal.controller.setup import RunSetup
from areal.tasks.base import Prompt, RewardOutcome, Task, Verdict

EVAL_KEY_OFFSET = 1 << 30
"""Prompt keys of held-out prompts start here (training prompts count up from 0)."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    prompt_median_tokens: float
    prompt_sigma: float
    prompt_max_tokens: int
    completion_median_tokens: float
    completion_sigma_prompt: float
    completion_sigma_sample: float
    reward_latency_s: float
    seed: int = 1

    @classmethod
    def from_costs(cls, costs: dict[str, Any], seed: int) -> Workload:
        values = {k: v["value"] for k, v in costs["workload"].items()}
        return cls(seed=seed, **values)

    def _normal(self, *key: Any) -> float:
        """A standard normal draw that depends on (seed, *key) only."""
        digest = hashlib.blake2b(repr((self.seed, *key)).encode(), digest_size=16).digest()
        u1 = (int.from_bytes(digest[:8], "little") + 0.5) / 2**64
        u2 = int.from_bytes(digest[8:], "little") / 2**64
        return math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)

    def prompt_tokens(self, prompt_key: int) -> int:
        z = self._normal("prompt", prompt_key)
        length = self.prompt_median_tokens * math.exp(self.prompt_sigma * z)
        return max(1, min(self.prompt_max_tokens, round(length)))

    def completion_tokens(self, prompt_key: int, sample: str, max_new_tokens: int) -> int:
        """Tokens the completion `sample` of prompt `prompt_key` runs for (<= the cap)."""
        z = self.completion_sigma_prompt * self._normal(
            "difficulty", prompt_key
        ) + self.completion_sigma_sample * self._normal("sample", prompt_key, sample)
        length = self.completion_median_tokens * math.exp(z)
        return max(1, min(max_new_tokens, round(length)))

    def correct(self, prompt_key: int, sample: str) -> bool:
        """Whether a completion is judged right (half of them; rewards only shape the
        advantages, which cost the same whatever their values)."""
        return self._normal("reward", prompt_key, sample) > 0


class SimTask(Task):
    """Prompts without text: each is identified by its key (its draw position)."""

    name = "sim"

    def __init__(self, num_eval: int = 1) -> None:
        self.num_eval = num_eval

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        key = 0
        while True:
            yield Prompt(prompt_id=f"sim-{key}", text="", reference=key)
            key += 1

    def eval_prompts(self) -> list[Prompt]:
        return [
            Prompt(prompt_id=f"sim-eval-{i}", text="", reference=EVAL_KEY_OFFSET + i)
            for i in range(self.num_eval)
        ]

    def reward(self, completion: str, reference: Any) -> RewardOutcome:
        raise NotImplementedError("simulated reward workers decide rewards (sim/workers.py)")


class SimSetup(RunSetup):
    """A RunSetup whose prompts are token arrays of sampled lengths (no tokenizer)."""

    workload: Workload

    def tokenize(self, prompt: Prompt) -> np.ndarray:
        key = int(prompt.reference)
        ids = np.zeros(self.workload.prompt_tokens(key), dtype=np.int32)
        ids[0] = key  # the rollout servers read the prompt's key here
        return ids

    async def next_train_prompt(self) -> tuple[int, Prompt, np.ndarray]:
        """As RunSetup's, without the thread (drawing a simulated prompt does no I/O), but
        yielding to the loop as the real one does while its thread runs."""
        await asyncio.sleep(0)
        return self._next_train_prompt_sync()

    def save_batch(self, step: int, version: int, batch: Any) -> None:
        """Simulated batches hold zeros: nothing worth saving."""


def prepare_sim_run(cfg: RunConfig, workload: Workload) -> SimSetup:
    """The simulation's `prepare_run`: a run directory and the synthetic task."""
    assert cfg.run_dir is not None  # the simulation always names its run directory
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    task = SimTask(cfg.eval.max_prompts or 1)
    setup = SimSetup(
        cfg=cfg,
        run_dir=run_dir,
        task=task,
        tokenizer=None,
        eval_prompts=[],
        stop_token_ids=[0],
        config_dict=config_to_dict(cfg),
    )
    setup.workload = workload
    setup.eval_prompts = [(p, setup.tokenize(p)) for p in task.eval_prompts()]
    setup._train_iter = task.train_prompts(cfg.seed)
    return setup


def prompt_key(prompt_ids: np.ndarray) -> int:
    return int(prompt_ids[0])


def reward_key(reference: Any) -> int:
    """The prompt key a reward is drawn for (`Workload.correct`): a simulated prompt's
    reference is its key (`SimTask`); anything else draws as key 0."""
    return int(reference) if isinstance(reference, int) else 0


def sample_name(request_id: str) -> str:
    """Which sample of its prompt a request is: the controller's request ids read
    'g<group>-s<index>-a<attempt>' (controller/ledger.py); the index, without the group (the
    same prompt may be another group in another run) or the attempt (a re-queued request is
    the same sample)."""
    return request_id.rsplit("-a", 1)[0].rsplit("-s", 1)[-1]


__all__ = [
    "SimSetup",
    "SimTask",
    "Verdict",
    "Workload",
    "prepare_sim_run",
    "prompt_key",
    "reward_key",
    "sample_name",
]
