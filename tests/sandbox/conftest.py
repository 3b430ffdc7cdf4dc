"""Fixtures for the sandbox tests: one warm launcher per session (started after a secret is
planted in this process's environment) and a check that runs leave no process behind."""

from __future__ import annotations

import os
import textwrap
import time

import psutil
import pytest

from areal.sandbox import ExecResult, Limits, Sandbox, SandboxConfig

SECRET_NAME = "AREAL_TEST_SECRET_TOKEN"
SECRET_VALUE = "s3cr3t-9f2c1e7a-do-not-leak"


@pytest.fixture
def secret() -> str:
    """The value planted in this process's environment before the launcher started."""
    return SECRET_VALUE


@pytest.fixture
def run_contained(sandbox):
    """Run a program and assert that nothing it started survives and the launcher lives."""

    def run(source: str, limits: Limits, stdin: bytes = b"") -> ExecResult:
        before = sandboxed_processes(sandbox)
        launcher = sandbox.launcher_pid
        result = sandbox.run(textwrap.dedent(source), stdin=stdin, limits=limits)
        assert wait_for_no_leftovers(sandbox, before) == set(), "processes survived the run"
        assert psutil.pid_exists(launcher) and sandbox.launcher_pid == launcher, "launcher died"
        return result

    return run


@pytest.fixture(scope="session")
def sandbox():
    os.environ[SECRET_NAME] = SECRET_VALUE  # a scrubbed environment must not pass this on
    sb = Sandbox(SandboxConfig())
    sb.start()
    yield sb
    sb.close()
    os.environ.pop(SECRET_NAME, None)


def sandboxed_processes(sb: Sandbox) -> set[int]:
    """Processes that can only belong to runs of `sb`: those running under a uid of its own
    block (root mode; the block is exclusive to its launcher, see zygote.claim_uid_block).
    Other sandboxes on the machine, with their own blocks and PID namespaces, are not
    counted. Without run uids (userns mode) a run cannot leave its PID namespace, whose
    processes all descend from the launcher: `wait_for_no_leftovers` looks there."""
    if not sb.isolation.run_uids:
        return set()
    first, last = sb.isolation.run_uids
    found = set()
    for proc in psutil.process_iter(["uids"]):
        try:
            if first <= proc.info["uids"].real <= last:
                found.add(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, TypeError):
            continue
    return found


def wait_for_no_leftovers(sb: Sandbox, before: set[int], timeout_s: float = 5.0) -> set[int]:
    """Processes a run left alive after `timeout_s`: processes of `sb`'s runs not there
    `before`, anything below the launcher's direct children, and direct children beyond the
    idle spare supervisors (the one that served the run exits right after answering)."""
    stop = time.monotonic() + timeout_s
    while True:
        launcher = psutil.Process(sb.launcher_pid)
        children = launcher.children()
        deeper = {p.pid for p in launcher.children(recursive=True)} - {p.pid for p in children}
        extra = {p.pid for p in children} if len(children) > sb.config.spare_supervisors else set()
        left = deeper | extra | (sandboxed_processes(sb) - before)
        if not left or time.monotonic() > stop:
            return left
        time.sleep(0.05)
