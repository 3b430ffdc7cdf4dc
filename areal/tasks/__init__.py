"""Tasks: prompts, references and rewards. `load_task` resolves a config name to an instance."""

from __future__ import annotations

import importlib
from typing import Any

from areal.tasks.base import Prompt, RewardOutcome, Task, Verdict

BUILTIN_TASKS = {
    "arithmetic": "areal.tasks.arithmetic:ArithmeticTask",
    "gsm8k": "areal.tasks.datasets:GSM8KTask",
    "math": "areal.tasks.datasets:MathTask",
    "code": "areal.tasks.datasets:CodeTask",
    "tool_arithmetic": "areal.tasks.tool_arithmetic:ToolArithmeticTask",
}
"""Built-in task names and the import paths they stand for."""


def load_task(name: str, params: dict[str, Any] | None = None) -> Task:
    """Instantiate a built-in task by name, or any `Task` subclass by 'package.module:Class'."""
    path = BUILTIN_TASKS.get(name, name)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"task.name={name!r} is neither a built-in task ({', '.join(BUILTIN_TASKS)}) nor an "
            "import path of the form 'package.module:Class'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"task.name={name!r}: cannot import module {module_name!r}: {err}"
        ) from err
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ValueError(f"task.name={name!r}: {path!r} is not a subclass of areal.tasks.Task")
    try:
        return cls(**(params or {}))
    except TypeError as err:
        raise ValueError(f"task.params for {name!r} do not fit {cls.__name__}: {err}") from err


__all__ = ["BUILTIN_TASKS", "Prompt", "RewardOutcome", "Task", "Verdict", "load_task"]
