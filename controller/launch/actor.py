"""The Ray actor that is one worker: `python -m areal.workers.<kind>` as the actor's child.

The worker runs the same entry point as everywhere else (local, Slurm, by hand), so a
worker behaves the same whatever started it. The child dies with the actor at once
(areal.workers.parent: the actor is its parent), so `ray.kill` or a lost node ends both;
a worker that exits ends the actor's `run` call with its exit code. Credentials come as an
argument of `run` and go only into the child's environment: not into the actor's runtime
environment (shown on Ray's dashboard), a command line or a log.

Imported by Ray's worker processes on every node: only the standard library here.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

PARENT_ENV = "AREAL_PARENT_PID"  # areal.workers.parent.PARENT_ENV, without importing areal


class WorkerActor:
    """Call `where()`, then `run(...)` (an actor runs its calls in order)."""

    def where(self) -> dict[str, str]:
        """The node this actor runs on: Ray node id, address, hostname, and its GPUs."""
        import ray

        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": str(os.getpid()),
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        }

    def run(self, kind: str, args: list[str], env: dict[str, str], log_path: str) -> int:
        """Start the worker, wait for it; its exit code. Output goes to `log_path` on this
        node (the run directory, when it is on storage the nodes share), or to a private
        directory under this node's temporary directory when that cannot be written."""
        environment = dict(os.environ, **env)
        environment[PARENT_ENV] = str(os.getpid())
        with _open_log(Path(log_path)) as out:
            process = subprocess.Popen(
                [sys.executable, "-m", f"areal.workers.{kind}", *args],
                env=environment,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        return process.wait()


def _open_log(path: Path):
    """The worker's log file, opened for the caller's `with` (hence no context manager)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "ab")
    except OSError as err:
        fallback = Path(tempfile.mkdtemp(prefix="areal-logs-")) / path.name
        out = open(fallback, "ab")  # noqa: SIM115
        out.write(
            f"[launcher] {path} cannot be written on this node ({err.strerror}); this "
            f"worker's output is in {fallback} on {socket.gethostname()}\n".encode()
        )
        return out
