"""The letter task with one slow verifier: a deterministic straggler for staleness tests.

The training prompt at index `late_index` gets a marked reference; its reward checks (in the
reward worker's threads) wait until `wait_for` other checks have finished after them, as a
verifier that is slow on one problem would. Its group therefore completes long after the
groups admitted with it: with an admission-only bound it is trained more than eta versions
after it was sampled, however fast the machine is (see test_strict_staleness_run.py for the
count). Counting checks, not seconds, makes that independent of the load. A check never
waits longer than `max_wait_s` (the run may end first).
Importable by workers as `late_reward_task:LateRewardTask` with this folder on PYTHONPATH.
"""

from __future__ import annotations

import threading
from typing import Any
from collections.abc import Iterator

from areal.tasks.base import Prompt, RewardOutcome
from letter_task import LetterTask

_LATE = "!late"


class LateRewardTask(LetterTask):
    name = "late_reward"

    def __init__(
        self, late_index: int = 1, wait_for: int = 32, max_wait_s: float = 60.0, **letter: Any
    ) -> None:
        super().__init__(**letter)
        self.late_index, self.wait_for, self.max_wait_s = late_index, wait_for, max_wait_s
        self._finished = 0
        self._changed = threading.Condition()

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        for prompt in super().train_prompts(seed):
            if prompt.prompt_id == f"train-{self.late_index}":
                prompt = Prompt(
                    prompt_id=prompt.prompt_id, text=prompt.text, reference=prompt.reference + _LATE
                )
            yield prompt

    def reward(self, completion: str, reference: Any) -> RewardOutcome:
        if reference.endswith(_LATE):
            with self._changed:
                target = self._finished + self.wait_for
                self._changed.wait_for(lambda: self._finished >= target, self.max_wait_s)
            return super().reward(completion, reference.removesuffix(_LATE))
        outcome = super().reward(completion, reference)
        with self._changed:
            self._finished += 1
            self._changed.notify_all()
        return outcome
