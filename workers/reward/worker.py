"""The reward worker: scores finished completions concurrently with generation.

Each completion of a `Score` (a group's, together) is decoded with the run's tokenizer and
checked by the task's reward function with bounded parallelism (`reward.max_concurrency`)
and a time limit (`reward.timeout_s`); one Scored answers for all. A check that times out
or raises becomes reward 0 with verdict TIMEOUT/ERROR and the reason in `detail`: a
trajectory is never lost because its checker failed. Rewards that run
untrusted code do so through `areal.sandbox`, inside the task's reward function.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from areal.messages import Score, Scored, WorkerKind
from areal.models.tokenizer import load_tokenizer
from areal.tasks import load_task
from areal.tasks.base import RewardOutcome, Verdict
from areal.workers.base import Worker

log = logging.getLogger(__name__)


class RewardWorker(Worker):
    kind = WorkerKind.REWARD

    async def setup(self, welcome) -> int:
        cfg = self.config
        self.task = await asyncio.to_thread(load_task, cfg.task.name, cfg.task.params)
        self.tokenizer = await asyncio.to_thread(
            load_tokenizer,
            cfg.model.tokenizer_dir(),
            trust_remote_code=cfg.model.trust_remote_code,
            cache_dir=cfg.cache_dir,
        )
        from areal.sandbox.pool import CheckerPool

        self.pool = CheckerPool(
            max_concurrency=cfg.reward.max_concurrency, timeout_s=cfg.reward.timeout_s
        )
        return welcome.version

    async def handle(self, msg: Any) -> None:
        if isinstance(msg, Score):
            self.spawn(self._score(msg), ",".join(msg.request_ids)[:200], msg.request_ids)
        else:
            log.warning("reward worker ignores %s", type(msg).__name__)

    async def _score(self, msg: Score) -> None:
        """Check every completion of `msg` at once (the pool bounds the parallelism) and
        answer with one Scored, in the same order."""
        outcomes = await asyncio.gather(
            *(self._check(ids, msg.reference) for ids in msg.completion_ids)
        )
        await self.send(
            Scored(
                request_ids=msg.request_ids,
                rewards=[float(o.reward) for o, _ in outcomes],
                verdicts=[o.verdict for o, _ in outcomes],
                details=[o.detail[:2000] for o, _ in outcomes],
                check_s=[seconds for _, seconds in outcomes],
            )
        )

    async def _check(self, completion_ids: Any, reference: Any) -> tuple[RewardOutcome, float]:
        """(outcome, seconds) of one completion; a completion the tokenizer cannot decode is
        an ERROR outcome, not a lost answer for its whole group."""
        start = time.monotonic()
        try:
            text = self.tokenizer.decode(completion_ids.tolist(), skip_special_tokens=True)
        except Exception as err:
            return RewardOutcome(
                reward=0.0,
                verdict=Verdict.ERROR,
                detail=f"could not decode the completion: {err!r}",
            ), 0.0
        outcome: RewardOutcome = await self.pool.check(self.task.reward, text, reference)
        return outcome, time.monotonic() - start

    async def close(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.close()


__all__ = ["RewardWorker", "Verdict"]
