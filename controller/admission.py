"""Admission: which training prompt groups enter the pipeline, and when.

    task prompts --> [admission loop] --G samples--> ledger.pending
        waits for: admission open, the run not stopping, and room under the staleness bound
        (areal.algorithms.staleness: floor((N_r - 1) / B) <= version + eta, N_r counting
        trajectories generated or in flight, the one admitted included)
        unblocked by: a training step (version + 1), a dropped group (its slots freed)

Owns the staleness counts (`staleness`), the log of admissions and whether admission is
open (closed once training ends). The counts move through this component's methods: a
sample generated, a batch consumed, a dropped group's samples released.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable

import numpy as np

from areal.algorithms.staleness import StalenessController
from areal.config import RunConfig
from areal.controller.ledger import Dropped, Group, Ledger
from areal.controller.signal import Changed
from areal.tasks.base import Prompt

ADMISSION_LOG_SIZE = 10_000
"""Admission entries kept (for tests and inspection; a long run must not grow with them)."""

NextPrompt = Callable[[], Awaitable[tuple[int, Prompt, np.ndarray]]]


class Admission:
    def __init__(
        self,
        cfg: RunConfig,
        ledger: Ledger,
        changed: Changed,
        version: Callable[[], int],
        stopping: Callable[[], bool],
    ) -> None:
        """`version`: the policy version in force; `stopping`: whether the run was asked to
        stop (no more admissions then)."""
        self.group_size = cfg.task.group_size
        self.ledger = ledger
        self.changed = changed
        self.version = version
        self.stopping = stopping
        self.staleness = StalenessController(cfg.trainer.batch_size, cfg.eta)
        self.open = True
        """False once training has ended: the final evaluation needs no training data."""
        self.log: collections.deque[dict[str, int]] = collections.deque(maxlen=ADMISSION_LOG_SIZE)
        """One entry per admitted training group (the newest ADMISSION_LOG_SIZE): its id,
        the version at admission, the trajectories generated or in flight after admitting it
        (N_r), and the prompt's draw position in the task's stream."""

    def can_admit(self) -> bool:
        return (
            self.open
            and not self.stopping()
            and self.staleness.capacity(self.version()) >= self.group_size
        )

    async def run(self, next_prompt: NextPrompt) -> None:
        """Admit a group of each next training prompt whenever the bound allows."""
        while True:
            await self.changed.wait_for(self.can_admit, at_notify=True)
            position, prompt, prompt_ids = await next_prompt()
            self.admit(position, prompt, prompt_ids)
            self.changed.notify()

    def admit(self, position: int, prompt: Prompt, prompt_ids: np.ndarray) -> Group:
        """A group of `prompt` into the ledger, counted in the staleness window."""
        version = self.version()
        self.staleness.admit(self.group_size, version)
        group = self.ledger.add_group(
            prompt, prompt_ids, self.group_size, version, position=position
        )
        self.log.append(
            {
                "group_id": group.group_id,
                "version": version,
                "num_admitted": self.staleness.num_live,
                "position": position,
            }
        )
        return group

    def close(self) -> None:
        self.open = False

    def generated(self, num_samples: int = 1) -> None:
        """Training samples finished generating."""
        if num_samples:
            self.staleness.finish(num_samples)

    def consumed(self, num_trajectories: int) -> None:
        """A batch was taken for training."""
        self.staleness.consume(num_trajectories)

    def released(self, dropped: Dropped) -> None:
        """A dropped group's samples leave the window: admission replaces them."""
        self.staleness.abort(dropped.num_unfinished)
        self.staleness.reject(dropped.num_finished)

    def resume(self, num_consumed: int) -> None:
        """Continue a run that had consumed `num_consumed` trajectories."""
        self.staleness.resume(num_consumed)
