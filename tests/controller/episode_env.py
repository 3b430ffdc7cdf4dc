"""An environment for runtime tests with a random tiny model (episode tests).

Whatever the model writes, its first turn is answered by running a Python program in the
real sandbox, chosen by the prompt's index (`index % 5`):

    0  print(6*7)          -> "42"                          then the episode ends
    1  1/0                 -> the traceback, runtime_error  then it ends (a failing tool)
    2  an endless loop     -> status timeout                then it ends (a slow tool)
    3  (the environment raises)                             -> EpisodeEnd.ERROR
    4  print(6*7), and every later turn answered too        -> EpisodeEnd.TURN_LIMIT

An episode that ends gets LetterTask's reward of all its model text (so RL has a signal).
Importable by workers as `episode_env:SandboxScriptEnvironment` with this folder on
PYTHONPATH (the task: `letter_task:LetterTask`).
"""

from __future__ import annotations

from typing import Any

from areal.tasks.base import RewardOutcome
from areal.tasks.environment import Environment, Episode, Observation, TurnRole
from areal.tasks.tools import PythonTool

PROGRAMS = {0: "print(6*7)", 1: "1/0", 2: "while True: pass", 4: "print(6*7)"}


class SandboxScriptEnvironment(Environment):
    def __init__(self, *, task: Any, tokenizer: Any, timeout_s: float = 0.5) -> None:
        super().__init__(task=task, tokenizer=tokenizer)
        self.python = PythonTool(timeout_s=timeout_s, memory_mb=256, max_output_chars=80)

    async def start(self) -> None:
        await self.python.start()

    async def close(self) -> None:
        await self.python.close()

    async def step(self, episode: Episode) -> Observation | RewardOutcome:
        case = int(episode.prompt_id.rsplit("-", 1)[1]) % 5
        if case == 3:
            raise RuntimeError("scripted environment failure")
        if episode.num_model_turns == 1 or case == 4:
            result = await self.python.call({"code": PROGRAMS[case]})
            return Observation(text=f"\n>{result.text}\n", num_tool_calls=1,
                               num_tool_errors=int(result.failed))
        text = "".join(t.text for t in episode.turns if t.role is TurnRole.MODEL)
        return self.task.reward(text, episode.reference)
