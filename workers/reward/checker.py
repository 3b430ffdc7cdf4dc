"""The task's reward function over a completion's tokens: what a reward worker runs for each
completion of a Score, and what a rollout worker runs for its own completions when the run
has no reward workers (reward.num_workers=0).

A completion is decoded with the run's tokenizer and checked by the task's reward function
in a `CheckerPool` (at most reward.max_concurrency at once, each within reward.timeout_s).
A check that times out or raises becomes reward 0 with verdict TIMEOUT/ERROR and the reason
in `detail`; a completion the tokenizer cannot decode is an ERROR outcome of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from areal.config import RunConfig
from areal.models.tokenizer import load_tokenizer
from areal.sandbox.pool import CheckerPool
from areal.tasks import load_task
from areal.tasks.base import RewardOutcome, Verdict

log = logging.getLogger(__name__)


class CompletionChecker:
    def __init__(self, task: Any, tokenizer: Any, pool: CheckerPool) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.pool = pool

    @classmethod
    async def start(cls, cfg: RunConfig) -> CompletionChecker:
        """The run's task, tokenizer and a checker pool (loaded off the event loop)."""
        task = await asyncio.to_thread(load_task, cfg.task.name, cfg.task.params)
        tokenizer = await asyncio.to_thread(
            load_tokenizer,
            cfg.model.tokenizer_dir(),
            trust_remote_code=cfg.model.trust_remote_code,
            cache_dir=cfg.cache_dir,
        )
        pool = CheckerPool(
            max_concurrency=cfg.reward.max_concurrency, timeout_s=cfg.reward.timeout_s
        )
        return cls(task, tokenizer, pool)

    async def check(self, completion_ids: Any, reference: Any) -> tuple[RewardOutcome, float]:
        """(outcome, seconds) of one completion (its token ids, an int array)."""
        start = time.monotonic()
        try:
            text = self.tokenizer.decode(completion_ids.tolist(), skip_special_tokens=True)
        except Exception as err:  # fault boundary: one completion's outcome, not the group's
            return RewardOutcome(
                reward=0.0,
                verdict=Verdict.ERROR,
                detail=f"could not decode the completion: {err!r}",
            ), 0.0
        outcome: RewardOutcome = await self.pool.check(self.task.reward, text, reference)
        return outcome, time.monotonic() - start

    async def check_retrying(
        self, completion_ids: Any, reference: Any, retries: int
    ) -> tuple[RewardOutcome, int]:
        """(outcome, times run again) of one completion, its check run again up to `retries`
        times while it ends in an infrastructure failure (`Verdict.is_error`): what the
        controller does with a reward worker's failed check (reward.retries), done where
        the check runs when there is no other reward worker to send it to."""
        outcome, _ = await self.check(completion_ids, reference)
        attempt = 0
        while attempt < retries and outcome.verdict.is_error():
            log.warning(
                "a reward check failed (%s: %s); running it again (retry %d of %d)",
                outcome.verdict.value,
                outcome.detail[:200],
                attempt + 1,
                retries,
            )
            outcome, _ = await self.check(completion_ids, reference)
            attempt += 1
        return outcome, attempt

    def close(self) -> None:
        self.pool.close()
