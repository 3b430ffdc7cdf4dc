"""Isolated execution of untrusted code, and the rewards built on it (code tests, math).

`Sandbox` runs a program in a child process under rlimits, a wall-clock timeout, fresh PID/
mount/network namespaces where the kernel allows them, a scrubbed environment and an empty
working directory, and returns a structured `ExecResult`; `Sandbox.start()` reports the
isolation in force (`IsolationReport`). `code_reward` and `math_reward` turn model
completions into `RewardOutcome`s; `CheckerPool` runs many checks concurrently with bounded
parallelism for the reward worker. The reward worker process itself (ZMQ, batching) lives
in `areal.workers.reward`, not here. Linux only.
"""

import importlib
from typing import Any

# Exports resolve lazily (PEP 562): the launcher process imports only the modules it runs,
# so every fork copies a smaller interpreter, and `import areal.sandbox` stays cheap.
_EXPORTS = {
    "Sandbox": "client",
    "IsolationError": "client",
    "SandboxStartError": "client",
    "CodeRewardConfig": "code_reward",
    "code_reward": "code_reward",
    "code_reward_async": "code_reward",
    "extract_code": "code_reward",
    "MathVerifier": "math_reward",
    "extract_answer": "math_reward",
    "math_reward": "math_reward",
    "CheckerPool": "pool",
    "ExecResult": "result",
    "ExecStatus": "result",
    "IsolationReport": "result",
    "CPP": "spec",
    "PYTHON": "spec",
    "PYTHON_EXEC": "spec",
    "Language": "spec",
    "Limits": "spec",
    "SandboxConfig": "spec",
    "SandboxConfigError": "spec",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'areal.sandbox' has no attribute {name!r}")
    return getattr(importlib.import_module(f"areal.sandbox.{_EXPORTS[name]}"), name)
