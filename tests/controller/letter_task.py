"""A task a randomly initialised tiny model can learn in a few steps (for runtime tests).

Reward: the share of one letter among the completion's characters. A random character
model writes it ~1 % of the time, so every group has reward differences to learn from, and
GRPO visibly raises the share within a few steps. Prompts are arbitrary short strings.
Importable by workers as `letter_task:LetterTask` with this folder on PYTHONPATH.
"""

from __future__ import annotations

import random
from typing import Any
from collections.abc import Iterator

from areal.tasks.base import Prompt, RewardOutcome, Task, Verdict


class LetterTask(Task):
    name = "letter"

    def __init__(self, letter: str = "a", num_eval: int = 8, flaky: float = 0.0) -> None:
        """flaky: the chance that a check fails for want of infrastructure (it raises, as a
        crashed verifier would), drawn anew at every attempt."""
        self.letter, self.num_eval, self.flaky = letter, num_eval, flaky
        self._faults = random.Random()

    def _prompt(self, rng: random.Random, split: str, index: int) -> Prompt:
        text = "".join(rng.choice("bcdefghij") for _ in range(4)) + ":"
        return Prompt(prompt_id=f"{split}-{index}", text=text, reference=self.letter)

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(seed)
        index = 0
        while True:
            yield self._prompt(rng, "train", index)
            index += 1

    def eval_prompts(self) -> list[Prompt]:
        rng = random.Random(-1)
        return [self._prompt(rng, "eval", i) for i in range(self.num_eval)]

    def reward(self, completion: str, reference: Any) -> RewardOutcome:
        if self.flaky and self._faults.random() < self.flaky:
            raise ConnectionError("the verifier service is unavailable (injected)")
        text = completion.replace("<|endoftext|>", "")
        share = text.count(reference) / len(text) if text else 0.0
        return RewardOutcome(reward=share, verdict=Verdict.OK if share >= 0.5 else Verdict.WRONG)
