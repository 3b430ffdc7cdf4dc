"""An environment for runtime tests with a random tiny model (episode tests).

Whatever the model writes, its first turn is answered by running a Python program in the
real sandbox, chosen by the prompt's index (`index % 5`):

    0  print(6*7)          -> "42"                          then the episode ends
    1  1/0                 -> the traceback, runtime_error  then it ends (a failing tool)
    2  an endless loop     -> status timeout                then it ends (a slow tool)
    3  (the environment raises)                             -> EpisodeEnd.ERROR
    4  print(6*7), and every later turn answered too        -> EpisodeEnd.TURN_LIMIT

With `weights_dir` (episode.params.weights_dir, the run's weight publications), case 4
of the training split (evaluation waits for no update) answers its first turn only once a
version newer than the newest there when the turn ended has been published, plus
`settle_s` for the rollout worker to load it (at most `wait_s` in all). Its next turn is
then sampled by a later policy than its first: an episode spanning versions in every run,
not only when an update happens to interrupt one.

An episode that ends gets LetterTask's reward of all its model text (so RL has a signal).
Importable by workers as `episode_env:SandboxScriptEnvironment` with this folder on
PYTHONPATH (the task: `letter_task:LetterTask`).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from areal.tasks.base import RewardOutcome
from areal.tasks.environment import Environment, Episode, Observation, TurnRole
from areal.tasks.tools import PythonTool

PROGRAMS = {0: "print(6*7)", 1: "1/0", 2: "while True: pass", 4: "print(6*7)"}


class SandboxScriptEnvironment(Environment):
    def __init__(
        self,
        *,
        task: Any,
        tokenizer: Any,
        timeout_s: float = 0.5,
        weights_dir: str | None = None,
        wait_s: float = 30.0,
        settle_s: float = 1.0,
    ) -> None:
        super().__init__(task=task, tokenizer=tokenizer)
        self.python = PythonTool(timeout_s=timeout_s, memory_mb=256, max_output_chars=80)
        self.weights_dir = Path(weights_dir) if weights_dir else None
        self.wait_s, self.settle_s = wait_s, settle_s

    async def start(self) -> None:
        await self.python.start()

    async def close(self) -> None:
        await self.python.close()

    async def step(self, episode: Episode) -> Observation | RewardOutcome:
        case = int(episode.prompt_id.rsplit("-", 1)[1]) % 5
        if case == 3:
            raise RuntimeError("scripted environment failure")
        if (
            case == 4
            and episode.num_model_turns == 1
            and self.weights_dir is not None
            and episode.prompt_id.startswith("train-")
        ):
            await self._newer_version_published()
        if episode.num_model_turns == 1 or case == 4:
            result = await self.python.call({"code": PROGRAMS[case]})
            return Observation(
                text=f"\n>{result.text}\n", num_tool_calls=1, num_tool_errors=int(result.failed)
            )
        text = "".join(t.text for t in episode.turns if t.role is TurnRole.MODEL)
        return self.task.reward(text, episode.reference)

    async def _newer_version_published(self) -> None:
        """Wait until a version newer than the newest published now exists, then `settle_s`
        (the update reaching this worker); give up after `wait_s` (the run goes on)."""
        newest = self._newest_version()
        deadline = time.monotonic() + self.wait_s
        while self._newest_version() <= newest:
            if time.monotonic() > deadline:
                return
            await asyncio.sleep(0.05)
        await asyncio.sleep(self.settle_s)

    def _newest_version(self) -> int:
        if not self.weights_dir.is_dir():
            return -1
        names = [p.name for p in self.weights_dir.glob("v[0-9]*")]
        return max((int(n[1:]) for n in names if n[1:].isdigit()), default=-1)
