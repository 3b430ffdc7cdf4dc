"""What the entry points import before they do any work, each in a fresh interpreter: the
controller's CLI reads its config and starts the fork server before it imports the
controller (and torch with it), and a rollout worker without agents does not import the
OpenAI client. Both are seconds of CPU at every run's start (controller/preload.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _imported_by(statement: str, modules: list[str]) -> list[str]:
    """Which of `modules` a fresh interpreter has imported after `statement`."""
    check = (
        f"import json, sys\n{statement}\n"
        f"print(json.dumps([m for m in {modules!r} if m in sys.modules]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize(
    "statement",
    [
        "import areal.controller",
        "import areal.controller.__main__",
        "import areal.controller.preload",
    ],
)
def test_the_controller_package_starts_without_the_controller_or_torch(statement):
    assert _imported_by(statement, ["areal.controller.controller", "torch"]) == []


def test_the_controller_is_imported_on_first_use():
    assert _imported_by(
        "from areal.controller import Controller, RunFailed", ["areal.controller.controller"]
    ) == ["areal.controller.controller"]
    done = subprocess.run(
        [sys.executable, "-c", "import areal.controller as c; c.Nothing"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "module 'areal.controller' has no attribute 'Nothing'" in done.stderr


def test_a_rollout_worker_imports_the_agent_runner_only_for_agents():
    assert _imported_by("import areal.workers.rollout.worker", ["openai", "uvicorn"]) == []
