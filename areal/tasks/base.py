"""What a task is: prompts with reference answers, and a reward function.

A task is a small class; users add their own by import path (`task.name=pkg.mod:MyTask`).
The controller reads prompts from it; reward workers call `Task.reward` on finished
completions, so a task must be constructible from its config params alone in any process,
and references must be plain data (str, numbers, lists, dicts) because they travel in
messages. A reward that could not be computed is not a wrong answer: `RewardOutcome`
carries a `Verdict` next to the number.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterator


class Verdict(str, enum.Enum):
    """How a check ended. OK/WRONG are real judgements; the rest mean 'could not judge'."""

    OK = "ok"
    """The check ran and the answer is correct (reward may still be partial credit)."""
    WRONG = "wrong"
    """The check ran and the answer is incorrect."""
    NO_ANSWER = "no_answer"
    """No answer could be extracted from the completion."""
    TIMEOUT = "timeout"
    """The check exceeded its time limit."""
    MEMORY = "memory"
    """The check exceeded its memory limit."""
    ERROR = "error"
    """The checker itself failed (a bug or a crash in the reward code)."""

    def is_error(self) -> bool:
        """True when the reward could not be computed (as opposed to a wrong answer)."""
        return self in (Verdict.TIMEOUT, Verdict.MEMORY, Verdict.ERROR)


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardOutcome:
    reward: float
    verdict: Verdict
    detail: str = ""
    """Human-readable reason, e.g. the first failing test or the error message."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Prompt:
    prompt_id: str
    """Stable id within the task's split (used for counting and deduplication)."""
    text: str
    """The full text fed to the tokenizer (templates already applied)."""
    reference: Any
    """Plain data the reward function checks against (msgpack-serialisable)."""


class Task(ABC):
    """Prompts for training and held-out evaluation, and the reward of a completion."""

    name: str = "task"

    @abstractmethod
    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        """Training prompts in the order to use them; may be endless (then epochs are the
        task's own business) or finite (the controller cycles them with a new seed)."""

    @abstractmethod
    def eval_prompts(self) -> list[Prompt]:
        """The held-out split, fixed for the life of the task."""

    @abstractmethod
    def reward(self, completion: str, reference: Any) -> RewardOutcome:
        """Score one completion (the generated text only, without the prompt)."""

    def use_tokenizer(self, tokenizer: Any) -> None:
        """The tokenizer that will tokenize this task's prompts, given before any prompt is
        asked for (controller, areal.eval); tasks that render chat templates keep it."""

    def use_tools(self, tools: list[dict[str, Any]]) -> None:
        """Tool definitions (JSON schema) of the run's environment (episode.environment),
        given before any prompt is asked for; tasks that render chat templates pass them as
        `apply_chat_template(..., tools=tools)`. Others need not: their prompts state the
        tool format themselves."""

    def stop_strings(self) -> list[str]:
        """Texts that end a completion early (the engines stop at the tokenizer's EOS too)."""
        return []
