"""The tool-use demonstration task: products of multi-digit numbers, a calculator at hand.

Run it with the calculator in the bracket format (examples/tool_arithmetic.yaml:
`episode.environment: tools`, `episode.params.tools: [calculator]`). The answer is checked
exactly as in the `arithmetic` task: the text after the first "#" must be the product.

    prompt       "482*37=?\\n"
    direct       "#17834" + EOS                 needs the product in one go: the embedded
                                                model rarely gets it right
    with a tool  "[482*37]"                     a model turn ending at "]" (a stop token)
                 "=17834\\n"                     the calculator's answer (context, not trained)
                 "#17834" + EOS                 copied from the observation

`sft_examples` gives the warm start both habits: a share `sft_direct_fraction` answers at
once, the rest call the calculator (`SFTEpisode`: the observation is context, not a target,
as in RL; its text is what `ToolEnvironment` returns with the default observation template).
RL has to find out that the tool pays. Operands have `a_digits` and `b_digits` digits. The
held-out split is fixed by `data_seed`; training prompts never repeat a held-out one.
This module builds no model and runs no tool.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterator

from areal.tasks.arithmetic import (
    ANSWER_MARK,
    ArithmeticTask,
    distinct_problems,
    problems_outside,
)
from areal.tasks.base import Prompt, RewardOutcome, Task
from areal.tasks.environment import SFTEpisode
from areal.tasks.tool_calls import BRACKET_CLOSE, BRACKET_OPEN

OBSERVATION = "={result}\n"
"""The calculator's answer as the environment writes it (ToolEnvironment's default
`observation_template`)."""


@dataclass(frozen=True)
class Product:
    a: int
    b: int

    @property
    def expression(self) -> str:
        return f"{self.a}*{self.b}"

    @property
    def text(self) -> str:
        return f"{self.expression}=?\n"

    @property
    def answer(self) -> int:
        return self.a * self.b


class ToolArithmeticTask(Task):
    """`a*b=?` answered directly or with the calculator; exact integer reward."""

    name = "tool_arithmetic"

    def __init__(
        self,
        *,
        a_digits: int = 3,
        b_digits: int = 2,
        num_eval: int = 256,
        data_seed: int = 0,
        sft_direct_fraction: float = 0.5,
    ) -> None:
        """
        a_digits, b_digits: digits of the two operands (1-9 each).
        num_eval: size of the held-out split.
        data_seed: seed of the held-out split and the training streams.
        sft_direct_fraction: share of `sft_examples` that answer without the calculator.
        """
        for key, digits in (("a_digits", a_digits), ("b_digits", b_digits)):
            if not 1 <= digits <= 9:
                raise ValueError(f"task.params.{key}={digits!r} must be in [1, 9]")
        if num_eval < 1:
            raise ValueError(f"task.params.num_eval={num_eval!r} must be >= 1")
        if not 0 <= sft_direct_fraction <= 1:
            raise ValueError(
                f"task.params.sft_direct_fraction={sft_direct_fraction!r} must be in [0, 1]"
            )
        self.a_digits, self.b_digits = a_digits, b_digits
        self.num_eval, self.data_seed = num_eval, data_seed
        self.sft_direct_fraction = float(sft_direct_fraction)
        self._checker = ArithmeticTask()
        self._eval: list[Prompt] | None = None
        self._eval_texts: frozenset[str] = frozenset()

    def _draw(self, rng: random.Random) -> Product:
        def operand(digits: int) -> int:
            return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)

        return Product(operand(self.a_digits), operand(self.b_digits))

    @staticmethod
    def _prompt(problem: Product, prompt_id: str) -> Prompt:
        return Prompt(prompt_id=prompt_id, text=problem.text, reference=problem.answer)

    def eval_prompts(self) -> list[Prompt]:
        """`num_eval` distinct products, fixed by `data_seed`."""
        if self._eval is None:
            problems = distinct_problems(
                self._draw,
                random.Random(f"tool_arithmetic/eval/{self.data_seed}"),
                self.num_eval,
                "products",
                "add digits",
            )
            self._eval = [self._prompt(p, f"eval-{i}") for i, p in enumerate(problems)]
            self._eval_texts = frozenset(p.text for p in problems)
        return self._eval

    def _train_problems(self, stream: str) -> Iterator[Product]:
        self.eval_prompts()
        return problems_outside(
            self._draw,
            random.Random(f"tool_arithmetic/{stream}/{self.data_seed}"),
            self._eval_texts,
            "products",
            "add digits",
        )

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        """An endless stream of training prompts (held-out ones never)."""
        for i, problem in enumerate(self._train_problems(f"train/{seed}")):
            yield self._prompt(problem, f"train-{seed}-{i}")

    def sft_examples(self, seed: int, num: int) -> list[SFTEpisode]:
        """`num` warm-start episodes, a share `sft_direct_fraction` answering directly."""
        mix = random.Random(f"tool_arithmetic/sft-direct/{self.data_seed}/{seed}")
        out = []
        for i, problem in enumerate(self._train_problems(f"sft/{seed}")):
            if i == num:
                break
            answer = f"{ANSWER_MARK}{problem.answer}"
            segments = (
                ((answer, True),)
                if mix.random() < self.sft_direct_fraction
                else (
                    (f"{BRACKET_OPEN}{problem.expression}{BRACKET_CLOSE}", True),
                    (OBSERVATION.replace("{result}", str(problem.answer)), False),
                    (answer, True),
                )
            )
            out.append(
                SFTEpisode(prompt=self._prompt(problem, f"sft-{seed}-{i}"), segments=segments)
            )
        return out

    def reward(self, completion: str, reference: Any) -> RewardOutcome:
        """1.0 if the text after the first '#' is one integer equal to `reference`."""
        return self._checker.reward(completion, reference)
