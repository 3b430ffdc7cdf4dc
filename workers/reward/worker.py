"""The reward worker: scores finished completions concurrently with generation.

Each `Score` is decoded with the run's tokenizer and checked by the task's reward function
with bounded parallelism (`reward.max_concurrency`) and a time limit (`reward.timeout_s`).
A check that times out or raises becomes reward 0 with verdict TIMEOUT/ERROR and the reason
in `detail`: a trajectory is never lost because its checker failed. Rewards that run
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
            load_tokenizer, cfg.model.tokenizer_path or cfg.model.path,
            trust_remote_code=cfg.model.trust_remote_code, cache_dir=cfg.cache_dir)
        from areal.sandbox.pool import CheckerPool

        self.pool = CheckerPool(max_concurrency=cfg.reward.max_concurrency,
                                timeout_s=cfg.reward.timeout_s)
        return welcome.version

    def num_running(self) -> int:
        return self.pool.in_flight

    def stats(self) -> dict[str, float]:
        return {f"reward/{k}": float(v) for k, v in self.pool.counts().items()}

    async def handle(self, msg: Any) -> None:
        if isinstance(msg, Score):
            self.spawn(self._score(msg), msg.request_id)
        else:
            log.warning("reward worker ignores %s", type(msg).__name__)

    async def _score(self, msg: Score) -> None:
        start = time.monotonic()
        text = self.tokenizer.decode(msg.completion_ids.tolist(), skip_special_tokens=True)
        outcome: RewardOutcome = await self.pool.check(self.task.reward, text, msg.reference)
        await self.send(Scored(request_id=msg.request_id, reward=float(outcome.reward),
                               verdict=outcome.verdict, detail=outcome.detail[:2000],
                               check_s=time.monotonic() - start))

    async def close(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.close()


__all__ = ["RewardWorker", "Verdict"]
