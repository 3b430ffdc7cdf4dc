"""Isolated execution of untrusted code, and the rewards built on it (code tests, math).

`Sandbox` runs a program in a child process under rlimits, a wall-clock timeout, fresh PID/
mount/network namespaces where the kernel allows them, a scrubbed environment and an empty
working directory, and returns a structured `ExecResult`. `code_reward` and `math_reward`
turn model completions into `RewardOutcome`s; `CheckerPool` runs many checks concurrently
with bounded parallelism for the reward worker. The reward worker process itself (ZMQ,
batching) lives in `areal.workers.reward`, not here.
"""

from areal.sandbox.client import IsolationError, Sandbox, SandboxStartError
from areal.sandbox.result import ExecResult, ExecStatus, IsolationReport
from areal.sandbox.spec import CPP, PYTHON, PYTHON_EXEC, Language, Limits, SandboxConfig, SandboxConfigError

__all__ = [
    "CPP", "PYTHON", "PYTHON_EXEC", "ExecResult", "ExecStatus", "IsolationError", "IsolationReport",
    "Language", "Limits", "Sandbox", "SandboxConfig", "SandboxConfigError", "SandboxStartError",
]
