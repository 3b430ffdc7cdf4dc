"""Environments: what answers the model between the turns of a multi-turn episode.

An episode is one trajectory in which model turns and observations alternate (docs/design.md
section 10):

    prompt | model turn 1 | observation 1 | model turn 2 | ... | model turn n
             sampled: version, behaviour     inserted by the environment: version -1,
             log-prob, loss mask True        log-prob 0, loss mask False (never trained)

The rollout worker runs the loop (areal.workers.rollout.episode): it generates until the
model's turn ends (a stop token, e.g. EOS or the tool-call marker of `stop_strings`, or the
turn's token budget), then awaits `Environment.step(episode)`. The environment either ends
the episode with a `RewardOutcome` or returns an `Observation` (a tool result, an error
message, a new user turn), whose text is tokenized and appended; the model goes on from
prompt + everything so far.

One environment instance serves all episodes of a process, concurrently: per-episode state
belongs in `Episode.state`, not on `self`. Configure it with `episode.environment`
(a built-in name or 'package.module:Class', loaded like a task) and `episode.params`; it is
built with the run's task and tokenizer (`Environment.__init__(task=, tokenizer=)`) plus
those params, in the controller (for `stop_strings` and `tools`, without `start`) and in
every rollout worker. A `step` that raises or runs past `episode.step_timeout_s` ends the
episode with reward 0 and verdict error / timeout: the episode is kept, never lost.

This module defines the interface and the loader; it runs no model and no tool.
"""

from __future__ import annotations

import enum
import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from areal.tasks.base import Prompt, RewardOutcome, Task

BUILTIN_ENVIRONMENTS = {
    "tools": "areal.tasks.tool_env:ToolEnvironment",
}
"""Built-in environment names and the import paths they stand for."""


class TurnRole(str, enum.Enum):
    MODEL = "model"
    """Sampled by the policy: trained on."""
    OBSERVATION = "observation"
    """Inserted by the environment: context only."""


@dataclass(kw_only=True)
class Turn:
    role: TurnRole
    text: str
    """Decoded text (special tokens skipped); for observations, the text the environment gave."""
    token_ids: list[int]
    stopped: bool = True
    """Model turns: ended by a stop token, the last of `token_ids` (False: the turn's token
    budget ran out)."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(kw_only=True)
class Observation:
    """The environment's answer to a model turn; the episode goes on."""

    text: str
    """Appended to the context as is (it must hold any template markup, e.g. the chat
    template's tool-message framing, and the start of the model's next turn)."""
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    """Tool calls that failed (malformed, unknown tool, error, timeout), for the metrics."""


@dataclass(kw_only=True)
class Episode:
    """What an environment sees: the prompt and every turn so far (the last is the model's)."""

    prompt_id: str
    prompt: str
    """The prompt text (decoded from its tokens)."""
    reference: Any
    """The task's reference for this prompt (plain data)."""
    turns: list[Turn] = field(default_factory=list)
    max_turns: int = 1
    state: dict[str, Any] = field(default_factory=dict)
    """Scratch space of the environment for this episode."""

    @property
    def last(self) -> Turn:
        """The model turn the environment is answering."""
        return self.turns[-1]

    @property
    def num_model_turns(self) -> int:
        return sum(t.role is TurnRole.MODEL for t in self.turns)

    @property
    def is_last_turn(self) -> bool:
        """No model turn may follow: an observation returned now ends the episode at the
        turn limit (reward 0), so this is the moment to score what there is."""
        return self.num_model_turns >= self.max_turns


class Environment(ABC):
    """Answers model turns of episodes (see the module docstring)."""

    def __init__(self, *, task: Task, tokenizer: Any) -> None:
        self.task = task
        self.tokenizer = tokenizer

    def stop_strings(self) -> list[str]:
        """Texts that end a model turn besides EOS (each one token), e.g. a tool-call marker."""
        return []

    def tools(self) -> list[dict[str, Any]]:
        """Tool definitions (JSON schema, the `tools=` of `apply_chat_template`) that prompts
        are rendered with; empty: none."""
        return []

    async def start(self) -> None:
        """Acquire what `step` needs (a sandbox, a connection); called once per process."""

    @abstractmethod
    async def step(self, episode: Episode) -> Observation | RewardOutcome:
        """Answer the model's last turn: an observation (the episode goes on) or the reward
        (it ends)."""

    async def close(self) -> None:
        """Release what `start` acquired; idempotent."""


def load_environment(
    name: str, params: dict[str, Any] | None, *, task: Task, tokenizer: Any
) -> Environment:
    """Instantiate a built-in environment by name, or any `Environment` subclass by
    'package.module:Class', with the run's task and tokenizer and `params`."""
    path = BUILTIN_ENVIRONMENTS.get(name, name)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"episode.environment={name!r} is neither a built-in environment "
            f"({', '.join(BUILTIN_ENVIRONMENTS)}) nor an import path 'package.module:Class'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"episode.environment={name!r}: cannot import module {module_name!r}: {err}"
        ) from err
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(
            f"episode.environment={name!r}: {path!r} is not a subclass of "
            "areal.tasks.environment.Environment"
        )
    try:
        return cls(task=task, tokenizer=tokenizer, **(params or {}))
    except TypeError as err:
        raise ValueError(f"episode.params for {name!r} do not fit {cls.__name__}: {err}") from err


@dataclass(frozen=True, kw_only=True)
class SFTEpisode:
    """A supervised warm-start episode (areal.models.warmstart): the prompt, then the
    completion as (text, trained) segments: the model's text is trained on, observations
    (what the environment would answer) are context only, as in RL."""

    prompt: Prompt
    segments: tuple[tuple[str, bool], ...]

    @property
    def completion(self) -> str:
        return "".join(text for text, _ in self.segments)


__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "Environment",
    "Episode",
    "Observation",
    "RewardOutcome",
    "SFTEpisode",
    "Turn",
    "TurnRole",
    "load_environment",
]
