"""The reward worker: scores finished completions concurrently with generation.

Each completion of a `Score` (a group's, together) is checked by the task's reward function
(checker.py: decoded with the run's tokenizer, bounded parallelism `reward.max_concurrency`,
a time limit `reward.timeout_s`); one Scored answers for all. A check that times out or
raises becomes reward 0 with verdict TIMEOUT/ERROR and the reason in `detail`: a trajectory
is never lost because its checker failed. Rewards that run untrusted code do so through
`areal.sandbox`, inside the task's reward function.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from areal.messages import Score, Scored, WorkerKind
from areal.tasks.base import Verdict
from areal.workers.base import Worker
from areal.workers.reward.checker import CompletionChecker

log = logging.getLogger(__name__)


class RewardWorker(Worker):
    kind = WorkerKind.REWARD

    async def setup(self, welcome) -> int:
        self.checker = await CompletionChecker.start(self.config)
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
            *(self.checker.check(ids, msg.reference) for ids in msg.completion_ids)
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

    async def close(self) -> None:
        checker = getattr(self, "checker", None)
        if checker is not None:
            checker.close()


__all__ = ["RewardWorker", "Verdict"]
