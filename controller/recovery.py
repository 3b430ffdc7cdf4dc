"""What a restarted trainer needs to become the one that was lost: the newest checkpoint and
the steps trained since it.

    Train messages of step s (one per rank) --record--> kept
    Trained(step s, checkpoint=path) from rank 0 --checkpointed--> kept: steps after s only
    trainer lost -> restart every rank from `checkpoint` -> `replays()` sent again (Train with
    replay=True: trained, not published) -> the ranks hold the run's current version

The steps since the newest checkpoint are at most trainer.checkpoint_every batches; they are
kept exactly as sent (shards, advantages, minibatch plans), so a replay repeats the lost
trainer's computation. With checkpoint_every = 0 nothing is kept and a lost rank fails the run.
"""

from __future__ import annotations

from dataclasses import replace

from areal.messages import Train


class TrainerRecovery:
    def __init__(self, checkpoint_every: int) -> None:
        self.enabled = checkpoint_every > 0
        self.checkpoint = ""
        """Newest complete checkpoint (a directory); empty: start from the config's model."""
        self.steps: list[list[Train]] = []
        self.num_restores = 0

    def record(self, messages: list[Train]) -> None:
        """A step about to be sent to the ranks (its Train message for each, in rank order)."""
        if self.enabled:
            self.steps.append(messages)

    def checkpointed(self, step: int, path: str) -> None:
        """Rank 0 saved `path` after step `step`: the steps up to it need no replay."""
        self.checkpoint = path
        self.steps = [messages for messages in self.steps if messages[0].step > step]

    def replays(self, before_step: int) -> list[list[Train]]:
        """The kept steps before `before_step` (the one in progress), marked as replays."""
        return [
            [replace(m, replay=True) for m in messages]
            for messages in self.steps
            if messages[0].step < before_step
        ]
