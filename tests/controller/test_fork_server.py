"""The fork server's child side (controller/fork_server.py); the server seen from the
controller is tested in test_preload.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

CHILD = """
import json, sys
from areal.controller.fork_server import become_worker
become_worker(json.loads(sys.argv[1]), int(sys.argv[2]))
"""


def _become_worker(tmp_path, server: int) -> tuple[int, str]:
    """Run become_worker in a fresh process (this one is its parent) for a module that
    writes to its log; its exit code and the log."""
    module = tmp_path / "ran_module.py"
    module.write_text("print('the worker ran')\n")
    log = tmp_path / "worker.log"
    request = {
        "module": "ran_module",
        "args": [],
        "env": {"PATH": os.environ["PATH"], "PYTHONPATH": str(tmp_path)},
        "cwd": str(tmp_path),
        "log": str(log),
    }
    child = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(request), str(server)], timeout=60
    )
    return child.returncode, log.read_text() if log.exists() else ""


def test_a_child_whose_server_died_before_it_started_dies_without_running(tmp_path):
    # The server forked it and died before the child ran: the child's parent is now
    # whoever adopted it, not the server it was forked by, and it must not live on.
    gone = subprocess.Popen(["true"])  # a server that has exited
    gone.wait()
    code, log = _become_worker(tmp_path, server=gone.pid)
    assert code == -signal.SIGKILL
    assert "the worker ran" not in log


def test_a_child_of_a_live_server_runs_its_module(tmp_path):
    code, log = _become_worker(tmp_path, server=os.getpid())
    assert code == 0 and "the worker ran" in log
