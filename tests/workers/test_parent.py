"""A local worker dies with the process that started it (areal.workers.parent), as real
processes: a stand-in controller starts a child that calls `die_with_parent`, and is then
killed with SIGKILL (it can do nothing about it); the child must be gone at once. The child
ignores SIGINT and SIGTERM, which are meant for its controller."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest

from areal.workers.parent import PARENT_ENV, die_with_parent, spawning

CHILD = textwrap.dedent("""
    import sys, time
    from areal.workers.parent import die_with_parent
    assert die_with_parent()
    print("armed", flush=True)
    time.sleep(120)
""")
PARENT = textwrap.dedent(f"""
    import os, subprocess, sys, time
    env = dict(os.environ, {PARENT_ENV}=str(os.getpid()))
    child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], env=env, stdout=subprocess.PIPE)
    assert child.stdout.readline() == b"armed\\n"
    print(child.pid, flush=True)
    time.sleep(120)
""")


@pytest.mark.slow
def test_the_child_dies_with_its_parent_and_ignores_signals_meant_for_the_parent():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        for signum in (signal.SIGINT, signal.SIGTERM):
            child.send_signal(signum)
        _, alive = psutil.wait_procs([child], timeout=0.5)
        assert alive == [child], "the child should ignore SIGINT and SIGTERM"
        parent.kill()
        parent.wait(10)
        gone, alive = psutil.wait_procs([child], timeout=10)
        assert gone and not alive, "the child outlived its parent"
    finally:
        parent.kill()
        parent.wait(10)


@pytest.mark.slow
def test_a_child_dies_with_the_thread_that_started_it_unless_spawning_started_it():
    """PR_SET_PDEATHSIG fires when the thread that forked the child ends, the process going
    on: `spawning` starts children from a thread that lasts as long as the process."""
    env = dict(os.environ, **{PARENT_ENV: str(os.getpid())})
    children: dict[str, subprocess.Popen] = {}

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE)

    def from_a_short_thread() -> None:
        children["direct"] = start()
        children["spawning"] = spawning(start)
        for child in children.values():  # armed while this thread is alive
            assert child.stdout.readline() == b"armed\n"

    thread = threading.Thread(target=from_a_short_thread)
    thread.start()
    thread.join()
    try:
        assert children["direct"].wait(10) == -signal.SIGKILL
        with pytest.raises(subprocess.TimeoutExpired):
            children["spawning"].wait(1)
    finally:
        for child in children.values():
            child.kill()
            child.wait(10)


def test_a_process_not_started_by_a_controller_is_left_alone():
    assert die_with_parent({}) is False
