"""Evaluation rounds: the held-out prompts generated and scored at one policy version.

    start(version) --> one eval group per held-out prompt, at the front of ledger.pending
                       (they overtake training work; samples at eval.temperature)
    group_scored   --> the round's last group scored: `round.done` is set
    finish(round)  --> forgotten (its groups were never kept in the buffer)

Owns the rounds in progress. The train driver starts rounds (before training, every
eval.every_steps steps, after training), waits for them and records their results
(report.eval_record).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from areal.controller.ledger import Group, Ledger, Purpose
from areal.controller.outbox import Outbox
from areal.tasks.base import Prompt


@dataclass(kw_only=True)
class EvalRound:
    round_id: int
    version: int
    """The policy version evaluated (in async mode a periodic round's samples may finish
    under newer weights: the eval record says which versions sampled)."""
    num_pending: int = 0
    """Groups not scored yet."""
    groups: list[Group] = field(default_factory=list)
    """Groups scored, in the order they completed."""
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Evaluations:
    def __init__(
        self, ledger: Ledger, prompts: list[tuple[Prompt, np.ndarray]], num_samples: int
    ) -> None:
        self.ledger = ledger
        self.prompts = prompts
        self.num_samples = num_samples
        self.rounds: dict[int, EvalRound] = {}
        """Rounds in progress, by id."""
        self._num_started = 0

    def start(self, version: int) -> EvalRound:
        """A round over every held-out prompt at `version`, queued ahead of training work."""
        round_ = EvalRound(round_id=self._num_started, version=version)
        self._num_started += 1
        self.rounds[round_.round_id] = round_
        for prompt, prompt_ids in self.prompts:
            self.ledger.add_group(
                prompt,
                prompt_ids,
                self.num_samples,
                version,
                Purpose.EVAL,
                eval_round=round_.round_id,
                front=True,
            )
            round_.num_pending += 1
        return round_

    def group_scored(self, group: Group, out: Outbox) -> None:
        """An evaluation group has every sample scored; the round's last wakes its waiter."""
        round_ = self.rounds[group.eval_round]
        round_.groups.append(group)
        round_.num_pending -= 1
        if round_.num_pending == 0:
            out.wake(round_.done.set)

    def finish(self, round_: EvalRound) -> None:
        del self.rounds[round_.round_id]
