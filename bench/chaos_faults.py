"""The faults bench/chaos.py injects into a running `python -m areal.controller`, from outside.

    RunUnderTest    the controller process (started, killed, resumed), its workers (its
                    descendants, by --worker-id) and the records it appends to metrics.jsonl
    inject(kind)    one fault, then waits until the run shows it survived it (the event
                    that proves the controller noticed and repaired it) and trained a step
                    after it; a fault not survived within the deadline is a hang

Kinds:
    kill_rollout, kill_reward, kill_trainer   kill -9 of that worker
    stop_rollout, stop_reward, stop_trainer   SIGSTOP past controller.heartbeat_timeout_s
    weight_load     the rollout worker is frozen while the trainer publishes from buffered
                    groups; the trainer is frozen too, the weights file of every version
                    published meanwhile deleted, and the worker thawed: it fails to load
                    (WeightsUpdated.error), and the trainer is thawed
    kill_controller kill -9 of the controller (its workers must die with it at once), then
                    `python -m areal.controller --resume RUN_DIR`
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

import psutil

KINDS = (
    "kill_rollout",
    "kill_reward",
    "kill_trainer",
    "stop_rollout",
    "stop_reward",
    "stop_trainer",
    "weight_load",
    "kill_controller",
)


WORKERS_EXIT_S = 30.0
"""How long the workers of a killed controller may take to exit. The kernel kills them at
once (PR_SET_PDEATHSIG, areal.workers.parent); a process of a few GB then takes a moment to
free its memory on a loaded machine. Their zombies are not waited for: they run nothing,
and their reaping is up to the init they were handed to, which on some machines reaps
every second or two."""


STOPPED_S = 2.0
"""How long a SIGSTOPped process may take to be seen stopped before the bench goes on."""


class Hang(RuntimeError):
    """The run made no progress within the deadline."""


def exited(process: psutil.Process) -> bool:
    """It runs no more: gone, or a zombie awaiting its reaping."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait(
    processes: list[psutil.Process],
    settled: Callable[[psutil.Process], bool],
    timeout_s: float,
    interval_s: float,
) -> tuple[float, list[psutil.Process]]:
    """Seconds until `settled` holds of every one of `processes` (or `timeout_s`), and
    those of which it does not hold then."""
    start = time.monotonic()
    while True:
        waiting = [p for p in processes if not settled(p)]
        waited = time.monotonic() - start
        if not waiting or waited > timeout_s:
            return waited, waiting
        time.sleep(interval_s)


def wait_exited(
    processes: list[psutil.Process], timeout_s: float
) -> tuple[float, list[psutil.Process]]:
    """Seconds until every one of `processes` exited (or `timeout_s`), and those still
    running then."""
    return _wait(processes, exited, timeout_s, 0.02)


def stopped(process: psutil.Process) -> bool:
    """It is stopped (SIGSTOP taken effect), or runs no more."""
    try:
        return process.status() == psutil.STATUS_STOPPED or exited(process)
    except psutil.NoSuchProcess:
        return True


def wait_stopped(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Until each of `processes` is stopped or has exited (a SIGSTOP takes effect when the
    kernel next runs the process, not when it is sent: on a busy machine a process can
    still be running moments after), or `timeout_s`; those still running then."""
    return _wait(processes, stopped, timeout_s, 0.005)[1]


@dataclass
class Fault:
    kind: str
    target: str = ""
    injected: bool = False
    survived: bool = False
    recovery_s: float = 0.0
    """From the injection to the first step trained after the repair."""
    detail: str = ""


@dataclass
class RunUnderTest:
    run_dir: Path
    overrides: list[str]
    log: Path
    deadline_s: float
    heartbeat_timeout_s: float
    batch_size: int
    proc: subprocess.Popen | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    _offset: int = 0
    _partial: bytes = b""

    # -- the controller -------------------------------------------------------------------------

    def start(self, resume: bool = False) -> None:
        args = ["--resume", str(self.run_dir)] if resume else self.overrides
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "areal.controller", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def workers(self) -> dict[str, psutil.Process]:
        out = {}
        try:
            # its children, or its fork server's (worker_start=preload)
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return out
        for child in children:
            try:
                # split again: a forked worker's title is one string (controller/preload.py)
                cmdline = " ".join(child.cmdline()).split()
            except psutil.NoSuchProcess:
                continue
            if "--worker-id" in cmdline:
                out[cmdline[cmdline.index("--worker-id") + 1]] = child
        return out

    # -- its records ----------------------------------------------------------------------------

    def poll(self) -> None:
        """Read the lines appended to metrics.jsonl since the last call."""
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return
        with open(path, "rb") as f:
            f.seek(self._offset)
            data = self._partial + f.read()
            self._offset = f.tell()
        *lines, self._partial = data.split(b"\n")
        self.records.extend(json.loads(line) for line in lines if line.strip())

    def find(self, since: int, kind: str = "event", **match: Any) -> int | None:
        """Index of the first record after `since` of `kind` with these fields, or None."""
        for index in range(since, len(self.records)):
            record = self.records[index]
            if record.get("kind") == kind and all(record.get(k) == v for k, v in match.items()):
                return index
        return None

    def wait_for(
        self, condition: Callable[[], Any], what: str, timeout_s: float | None = None
    ) -> Any:
        deadline = time.monotonic() + (timeout_s or self.deadline_s)
        while True:
            self.poll()
            value = condition()
            if value:
                return value
            if self.proc.poll() is not None:
                raise Hang(f"the controller exited ({self.proc.returncode}) waiting for {what}")
            if time.monotonic() > deadline:
                raise Hang(f"no {what} within {timeout_s or self.deadline_s:.0f} s")
            time.sleep(0.2)

    def wait_steps(self, count: int) -> int:
        """Wait until `count` more step records were appended; returns the last's index."""
        since = len(self.records)
        self.wait_for(
            lambda: sum(r["kind"] == "step" for r in self.records[since:]) >= count,
            f"{count} more training steps",
        )
        return len(self.records) - 1

    # -- faults ---------------------------------------------------------------------------------

    def inject(self, fault: Fault) -> None:
        """Inject `fault` and wait for the run to repair it and train a step after it."""
        start, mark = time.monotonic(), len(self.records)
        repaired = getattr(self, f"_{fault.kind.split('_', 1)[0]}")(fault, mark)
        self.wait_for(
            lambda: self.find(repaired + 1, "step") is not None, f"training step after {fault.kind}"
        )
        fault.survived, fault.recovery_s = True, time.monotonic() - start

    def _target(self, fault: Fault) -> psutil.Process:
        kind = "rollout" if fault.kind == "weight_load" else fault.kind.split("_", 1)[1]
        name, proc = next((n, p) for n, p in sorted(self.workers().items()) if n.startswith(kind))
        fault.target = name
        return proc

    def _lost_then_back(self, fault: Fault, mark: int, reason: str | None = None) -> int:
        lost = self.wait_for(
            lambda: self.find(mark, worker_id=fault.target, event="worker_lost"),
            f"worker_lost of {fault.target}",
        )
        if reason is not None and self.records[lost].get("reason") != reason:
            fault.detail = f"lost as {self.records[lost].get('reason')!r}"
        if fault.target.startswith("trainer"):
            return self.wait_for(
                lambda: self.find(lost, event="trainer_restored"), "trainer_restored"
            )
        return self.wait_for(
            lambda: self.find(lost, worker_id=fault.target, event="worker_ready"),
            f"{fault.target} ready",
        )

    def _kill(self, fault: Fault, mark: int) -> int:
        if fault.kind == "kill_controller":
            return self._kill_controller(fault, mark)
        self._target(fault).send_signal(signal.SIGKILL)
        fault.injected = True
        return self._lost_then_back(fault, mark)

    def _stop(self, fault: Fault, mark: int) -> int:
        proc = self._target(fault)
        proc.send_signal(signal.SIGSTOP)
        fault.injected = True
        try:
            return self._lost_then_back(fault, mark, reason="silent")
        finally:
            if proc.is_running():  # the controller kills it; never leave one stopped
                proc.send_signal(signal.SIGCONT)

    def _weight(self, fault: Fault, mark: int) -> int:
        for _ in range(5):  # the trainer may not publish while the worker is frozen: again
            # the lambdas are called within this iteration (wait_for), so `mark` is current
            self.wait_for(
                lambda: any(
                    r["kind"] == "step" and r["buffer/trajectories"] >= self.batch_size
                    for r in self.records[mark:]  # noqa: B023
                ),
                "a full batch buffered",
            )
            trainers = self._delete_while_frozen(fault)
            if trainers is None:
                mark = len(self.records)
                continue
            try:  # thawed once the worker has failed: no later version can spare it
                failed = self.wait_for(
                    lambda: self.find(mark, event="weights_load_failed"),  # noqa: B023
                    "weights_load_failed",
                    timeout_s=self.heartbeat_timeout_s / 2,
                )
            finally:
                for proc in trainers:
                    proc.send_signal(signal.SIGCONT)
            return int(failed)
        raise Hang("the trainer published no version while the rollout worker was frozen")

    def _delete_while_frozen(self, fault: Fault) -> list[psutil.Process] | None:
        """Freeze the rollout worker (for at most half the heartbeat timeout); once the
        trainer has published a version past the newest one before, freeze the trainer
        ranks too, delete the weights file of every version published since (not the
        directories: the trainer may still be syncing them), and thaw the worker. Every
        one, not only the first: a thawed worker skips to the newest update it holds. And
        the trainer stays frozen until the worker has failed: a version published after
        the deletion, still queued for the worker when it reads its updates, would be
        loaded instead. The frozen trainer ranks, for the caller to thaw; None if the
        trainer published nothing in time (nothing was deleted)."""
        proc = self._target(fault)
        weights = self.run_dir / "weights"
        before = max(p.name for p in weights.iterdir())

        def published() -> list[Path]:
            return [
                f
                for p in sorted(weights.iterdir())
                if p.name > before
                for f in p.glob("*.safetensors")
            ]

        trainers: list[psutil.Process] = []
        proc.send_signal(signal.SIGSTOP)
        try:
            try:
                self.wait_for(
                    published, "a new weight version", timeout_s=self.heartbeat_timeout_s / 2
                )
            except Hang:
                return None
            time.sleep(0.2)  # the controller relays UpdateWeights to the frozen worker
            trainers = [p for n, p in self.workers().items() if n.startswith("trainer")]
            for trainer in trainers:
                trainer.send_signal(signal.SIGSTOP)
            wait_stopped(trainers, STOPPED_S)  # frozen before anything is deleted
            newest = published()
            for path in newest:
                path.unlink(missing_ok=True)
            fault.detail = f"deleted {', '.join(p.parent.name for p in newest)}"
            fault.injected = True
            return trainers
        except BaseException:
            for trainer in trainers:
                trainer.send_signal(signal.SIGCONT)
            raise
        finally:
            proc.send_signal(signal.SIGCONT)

    def _kill_controller(self, fault: Fault, mark: int) -> int:
        workers = list(self.workers().values())
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        fault.injected, fault.target = True, "controller"
        waited, alive = wait_exited(workers, WORKERS_EXIT_S)
        fault.detail = (
            f"{len(workers) - len(alive)}/{len(workers)} workers died with it in {waited:.2f} s"
        )
        for orphan in alive:
            orphan.kill()
        if alive:
            raise Hang(f"{len(alive)} workers outlived their controller")
        self.start(resume=True)
        return self.wait_for(lambda: self.find(mark, event="resumed"), "the resumed run")

    def stop(self) -> int:
        """SIGTERM: the run ends after the current step, with its summary; the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(self.deadline_s)
        except subprocess.TimeoutExpired:
            raise Hang("the controller did not stop after SIGTERM") from None

    def kill_all(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for worker in self.workers().values():
                worker.kill()
            self.proc.kill()
            self.proc.wait()
