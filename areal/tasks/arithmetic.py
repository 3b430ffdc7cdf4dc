"""The embedded default task: `a+d*k`, worked out by repeated addition, one step per line.

Prompt: the expression, "=?" and a newline. Completion: each line is the expression after
one more addition (an equivalent expression, so every line can be checked by eye), then the
answer after "#", then the tokenizer's EOS token (the engines stop there; the text holds no
stop marker)::

    prompt      "17+8*5=?\\n"
    completion  "25+8*4\\n33+8*3\\n41+8*2\\n49+8*1\\n#57"  + EOS

The trace has k-1 lines, so the distribution of k sets the distribution of completion
lengths: `k_alpha=0` draws k uniformly from [min_k, max_k], `k_alpha>0` from a power law
P(k) ~ (k - min_k + 1)^-k_alpha, the long tail of reasoning-trace lengths
(`ArithmeticTask.long_tail()`). Each line needs only the line above it (add d, count k
down), which a tiny model learns quickly; the answer in one go needs d*k, which it does not.

The held-out split is drawn once from `data_seed`; training prompts come from their own
stream (seeded by `data_seed` and the run seed) that skips every held-out expression, so the
two splits never share a prompt. References are plain ints. The reward is exact: the text
after the first "#" must be an integer equal to the reference (1.0, `Verdict.OK`); another
integer is `Verdict.WRONG`; no "#", or anything but one integer after it, is
`Verdict.NO_ANSWER` (reward 0). The trace itself is not checked.

`sft_examples` supplies the supervised targets that `areal.models.warmstart` trains on. A
share `sft_direct_fraction` of them answers at once ("#57", no trace): the warm-started
model then mixes a habit that rarely works (answering directly) with one that usually does
(working it out), and RL has to find out which pays, as reasoning models learn to spend
tokens on thinking. This module builds no model and runs no generation.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Iterator

from areal.tasks.base import Prompt, RewardOutcome, Task, Verdict

EOS_TEXT = "<|endoftext|>"
"""The char tokenizer's EOS as text; stripped if a decoder kept special tokens."""
ANSWER_MARK = "#"
_ANSWER_RE = re.compile(r"\s*(-?\d+)\s*")
_MAX_MISSES = 1000
"""Rejection-sampling attempts in a row before declaring the expression space too small."""


def distinct_problems(
    draw: Callable[[random.Random], Any], rng: random.Random, num: int, what: str, hint: str
) -> list[Any]:
    """`num` problems of distinct `.text` from `draw(rng)`, in draw order (a held-out split);
    a ValueError naming `hint` when the setting has too few."""
    seen: dict[str, Any] = {}
    misses = 0
    while len(seen) < num:
        problem = draw(rng)
        if problem.text in seen:
            misses += 1
            if misses > _MAX_MISSES:
                raise ValueError(
                    f"task.params.num_eval={num}: only {len(seen)} distinct {what} "
                    f"found; lower num_eval or {hint}"
                )
            continue
        misses = 0
        seen[problem.text] = problem
    return list(seen.values())


def problems_outside(
    draw: Callable[[random.Random], Any],
    rng: random.Random,
    excluded: frozenset[str],
    what: str,
    hint: str,
) -> Iterator[Any]:
    """An endless stream of `draw(rng)` whose `.text` is not in `excluded` (the held-out
    split); a ValueError naming `hint` when nearly every draw is excluded."""
    misses = 0
    while True:
        problem = draw(rng)
        if problem.text in excluded:
            misses += 1
            if misses > _MAX_MISSES:
                raise ValueError(
                    f"the held-out split covers nearly all {what} of this setting; "
                    f"lower task.params.num_eval or {hint}"
                )
            continue
        misses = 0
        yield problem


@dataclass(frozen=True, kw_only=True)
class SFTExample:
    """A supervised warm-start pair: the prompt and the completion text the model should
    produce (without EOS; the trainer appends the tokenizer's EOS token)."""

    prompt: Prompt
    completion: str


@dataclass(frozen=True)
class Problem:
    """The expression a+d*k."""

    a: int
    d: int
    k: int

    @property
    def text(self) -> str:
        return f"{self.a}+{self.d}*{self.k}=?\n"

    @property
    def answer(self) -> int:
        return self.a + self.d * self.k

    def trace(self) -> str:
        """k-1 reduction lines, then the answer line."""
        lines = [f"{self.a + self.d * i}+{self.d}*{self.k - i}" for i in range(1, self.k)]
        return "\n".join([*lines, f"{ANSWER_MARK}{self.answer}"])


class ArithmeticTask(Task):
    """`a+d*k=?` solved step by step; exact integer reward."""

    name = "arithmetic"

    def __init__(
        self,
        *,
        min_k: int = 2,
        max_k: int = 6,
        k_alpha: float = 0.0,
        max_a: int = 99,
        max_d: int = 9,
        num_eval: int = 256,
        data_seed: int = 0,
        sft_direct_fraction: float = 0.5,
    ) -> None:
        """
        min_k, max_k: range of the multiplier k (the trace has k-1 lines).
        k_alpha: 0 draws k uniformly; > 0 draws P(k) ~ (k - min_k + 1)^-k_alpha.
        max_a: a is drawn uniformly from [0, max_a].
        max_d: d is drawn uniformly from [1, max_d].
        num_eval: size of the held-out split.
        data_seed: seed of the held-out split and of the training streams' base.
        sft_direct_fraction: share of `sft_examples` that answer at once, without a trace.
        """
        if not 1 <= min_k <= max_k:
            raise ValueError(
                f"task.params: need 1 <= min_k <= max_k, got min_k={min_k}, max_k={max_k}"
            )
        if k_alpha < 0:
            raise ValueError(f"task.params.k_alpha={k_alpha!r} must be >= 0")
        if max_a < 0:
            raise ValueError(f"task.params.max_a={max_a!r} must be >= 0")
        if max_d < 1:
            raise ValueError(f"task.params.max_d={max_d!r} must be >= 1")
        if num_eval < 1:
            raise ValueError(f"task.params.num_eval={num_eval!r} must be >= 1")
        if not 0 <= sft_direct_fraction <= 1:
            raise ValueError(
                f"task.params.sft_direct_fraction={sft_direct_fraction!r} must be in [0, 1]"
            )
        self.min_k, self.max_k, self.k_alpha = min_k, max_k, float(k_alpha)
        self.max_a, self.max_d = max_a, max_d
        self.num_eval, self.data_seed = num_eval, data_seed
        self.sft_direct_fraction = float(sft_direct_fraction)
        self._ks = list(range(min_k, max_k + 1))
        self._k_weights = [(k - min_k + 1) ** -self.k_alpha for k in self._ks]
        self._eval: list[Prompt] | None = None
        self._eval_texts: frozenset[str] = frozenset()

    @classmethod
    def long_tail(cls, **overrides: Any) -> ArithmeticTask:
        """Long-tailed completion lengths: k from 2 to 40, power law (median ~20 tokens,
        longest ~340)."""
        params: dict[str, Any] = dict(min_k=2, max_k=40, k_alpha=1.2)
        params.update(overrides)
        return cls(**params)

    def params(self) -> dict[str, Any]:
        """The constructor arguments: everything that determines prompts and rewards."""
        return dict(
            min_k=self.min_k,
            max_k=self.max_k,
            k_alpha=self.k_alpha,
            max_a=self.max_a,
            max_d=self.max_d,
            num_eval=self.num_eval,
            data_seed=self.data_seed,
            sft_direct_fraction=self.sft_direct_fraction,
        )

    # ---- data -------------------------------------------------------------------------

    def _draw(self, rng: random.Random) -> Problem:
        (k,) = rng.choices(self._ks, weights=self._k_weights)
        return Problem(rng.randint(0, self.max_a), rng.randint(1, self.max_d), k)

    @staticmethod
    def _prompt(problem: Problem, prompt_id: str) -> Prompt:
        return Prompt(prompt_id=prompt_id, text=problem.text, reference=problem.answer)

    def eval_prompts(self) -> list[Prompt]:
        """`num_eval` distinct expressions, fixed by `data_seed`."""
        if self._eval is None:
            problems = distinct_problems(
                self._draw,
                random.Random(f"arithmetic/eval/{self.data_seed}"),
                self.num_eval,
                "expressions",
                "widen max_a/max_d/max_k",
            )
            self._eval = [self._prompt(p, f"eval-{i}") for i, p in enumerate(problems)]
            self._eval_texts = frozenset(p.text for p in problems)
        return self._eval

    def _train_problems(self, stream: str) -> Iterator[Problem]:
        self.eval_prompts()  # the training stream must know what to skip
        return problems_outside(
            self._draw,
            random.Random(f"arithmetic/{stream}/{self.data_seed}"),
            self._eval_texts,
            "expressions",
            "widen max_a/max_d/max_k",
        )

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        """An endless stream of training prompts (repeats possible, held-out ones never)."""
        for i, problem in enumerate(self._train_problems(f"train/{seed}")):
            yield self._prompt(problem, f"train-{seed}-{i}")

    def sft_examples(self, seed: int, num: int) -> list[SFTExample]:
        """`num` supervised pairs from the training distribution (never held-out prompts),
        a share `sft_direct_fraction` of them answering without the trace. The stream is
        apart from `train_prompts(seed)`, so RL starts on prompts the warm start never saw
        in that order; the same (seed, num) always gives the same examples."""
        mix = random.Random(f"arithmetic/sft-direct/{self.data_seed}/{seed}")
        out = []
        for i, problem in enumerate(self._train_problems(f"sft/{seed}")):
            if i == num:
                break
            direct = mix.random() < self.sft_direct_fraction
            completion = f"{ANSWER_MARK}{problem.answer}" if direct else problem.trace()
            out.append(
                SFTExample(prompt=self._prompt(problem, f"sft-{seed}-{i}"), completion=completion)
            )
        return out

    # ---- reward -----------------------------------------------------------------------

    def reward(self, completion: str, reference: Any) -> RewardOutcome:
        """1.0 if the text after the first '#' is one integer equal to `reference`."""
        text = completion.replace(EOS_TEXT, "")
        _, mark, tail = text.partition(ANSWER_MARK)
        match = _ANSWER_RE.fullmatch(tail) if mark else None
        if match is None:
            detail = "no '#'" if not mark else f"no single integer after '#': {tail[:40]!r}"
            return RewardOutcome(reward=0.0, verdict=Verdict.NO_ANSWER, detail=detail)
        answer = int(match.group(1))
        if answer == int(reference):
            return RewardOutcome(reward=1.0, verdict=Verdict.OK)
        return RewardOutcome(
            reward=0.0,
            verdict=Verdict.WRONG,
            detail=f"answered {answer}, expected {int(reference)}",
        )
