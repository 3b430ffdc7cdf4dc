"""The worker life cycle over a real socket: register, set up, serve, and the exit code a
Shutdown leads to (a launcher restarts a worker that exits with REJOIN_EXIT_CODE); a worker
writes final artifacts only when told the run finished, and stops on its own when the
controller falls silent."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq.asyncio

from areal.config import config_to_dict, load_config
from areal.messages import (
    PROTOCOL_VERSION,
    REJOIN_EXIT_CODE,
    Cancel,
    Heartbeat,
    Ready,
    Register,
    Shutdown,
    Welcome,
    WorkerError,
    WorkerKind,
)
from areal.transport import RouterChannel
from areal.workers.base import Worker


class EchoWorker(Worker):
    kind = WorkerKind.REWARD

    async def setup(self, welcome: Welcome) -> int:
        return welcome.version

    async def handle(self, msg: Any) -> None:
        pass


@contextlib.asynccontextmanager
async def _serving(
    worker_cls: type[Worker], worker_id: str
) -> AsyncIterator[tuple[RouterChannel, Worker, asyncio.Task]]:
    """A `worker_cls` serving against a bare ROUTER on loopback: (the ROUTER, the worker, its
    serve task); the socket closed on the way out."""
    ctx = zmq.asyncio.Context()
    channel = RouterChannel(ctx, "127.0.0.1", 0)
    worker = worker_cls(channel.address, worker_id, secret="s")
    try:
        yield channel, worker, asyncio.create_task(worker.serve())
    finally:
        channel.close()
        ctx.term()


async def _serve_until(shutdown: Shutdown | None, overrides: list[str] = ()):
    """Run an EchoWorker against a bare ROUTER; after Ready, send `shutdown` (None: stay
    silent). Returns (exit code, message types seen, Ready's version, the worker)."""
    seen = []
    async with _serving(EchoWorker, "echo-0") as (channel, worker, serving):
        identity, msg = await asyncio.wait_for(channel.recv(), 10)
        seen.append(type(msg))
        await channel.send(
            identity, Welcome(config=config_to_dict(load_config(overrides=overrides)), version=4)
        )
        while not isinstance(msg, Ready):
            identity, msg = await asyncio.wait_for(channel.recv(), 10)
        seen.append(type(msg))
        if shutdown is not None:
            await channel.send(identity, shutdown)
        return await asyncio.wait_for(serving, 60), seen, msg.version, worker


@pytest.mark.parametrize("rejoin, code", [(False, 0), (True, REJOIN_EXIT_CODE)])
def test_shutdown_exit_code_says_whether_to_start_the_worker_again(rejoin, code):
    exit_code, seen, version, worker = asyncio.run(
        _serve_until(Shutdown(reason="test", rejoin=rejoin))
    )
    assert seen == [Register, Ready] and version == 4
    assert exit_code == code
    assert not worker.finished


def test_a_worker_has_no_connection_or_configuration_before_serving_and_its_welcome():
    worker = EchoWorker("tcp://127.0.0.1:1", "echo-9", secret="s")
    with pytest.raises(RuntimeError, match="echo-9 is not connected"):
        _ = worker.channel
    with pytest.raises(RuntimeError, match="echo-9 has no run configuration.*Welcome"):
        _ = worker.config
    _, _, _, served = asyncio.run(_serve_until(Shutdown(reason="done")))
    assert served.config.mode == load_config().mode  # the Welcome's, kept after serving


def test_only_a_finished_run_asks_for_final_artifacts():
    exit_code, _, _, worker = asyncio.run(_serve_until(Shutdown(reason="done", final=True)))
    assert exit_code == 0 and worker.finished


def test_a_worker_stops_on_its_own_when_the_controller_falls_silent():
    exit_code, _, _, worker = asyncio.run(
        _serve_until(
            None, ["controller.heartbeat_interval_s=0.1", "controller.heartbeat_timeout_s=0.5"]
        )
    )
    assert exit_code == 3  # controller lost
    assert not worker.finished  # so a trainer writes no final_model


class AnsweringWorker(EchoWorker):
    """Answers every message from the controller (as a rollout worker answers a Generate)."""

    async def handle(self, msg: Any) -> None:
        await self.send(WorkerError(error="an answer"))


async def _heartbeats_idle_then_busy(
    interval: float | None, span: float, timeout: float = 30
) -> tuple[int, int, int]:
    """An AnsweringWorker after Ready, with the heartbeat interval `interval` (None: the
    automatic one): `span` s sent only Heartbeats (each interval / 2, so that a short
    `timeout` does not end it), then `span` s also a message every interval / 4. Returns
    (Heartbeats while idle, Heartbeats while busy, answers)."""
    overrides = [f"controller.heartbeat_timeout_s={timeout}"]
    if interval is not None:
        overrides.append(f"controller.heartbeat_interval_s={interval}")
    interval = load_config(overrides=overrides).heartbeat_interval()
    counts = {"idle": 0, "busy": 0, "answers": 0}
    phase = "idle"

    async def receive() -> None:
        while True:
            _, msg = await channel.recv()
            if isinstance(msg, Heartbeat):
                counts[phase] += 1
            elif isinstance(msg, WorkerError):
                counts["answers"] += 1

    async def beat() -> None:  # the controller's liveness rounds: no answer expected
        while True:
            await asyncio.sleep(interval / 2)
            await channel.send(identity, Heartbeat())

    async with _serving(AnsweringWorker, "answers-0") as (channel, _, serving):
        identity, _ = await asyncio.wait_for(channel.recv(), 10)
        welcome = Welcome(config=config_to_dict(load_config(overrides=overrides)), version=0)
        await channel.send(identity, welcome)
        msg: Any = None
        while not isinstance(msg, Ready):
            _, msg = await asyncio.wait_for(channel.recv(), 10)
        receiving = asyncio.create_task(receive())
        beating = asyncio.create_task(beat())
        await asyncio.sleep(span)
        phase = "busy"
        for _ in range(int(span / (interval / 4))):
            await channel.send(identity, Cancel(request_ids=["r"]))
            await asyncio.sleep(interval / 4)
        receiving.cancel()
        beating.cancel()
        await channel.send(identity, Shutdown(reason="test"))
        assert await asyncio.wait_for(serving, 30) == 0
        return counts["idle"], counts["busy"], counts["answers"]


def test_a_worker_sends_heartbeats_only_in_intervals_in_which_it_sent_nothing_else():
    idle, busy, answers = asyncio.run(_heartbeats_idle_then_busy(interval=0.2, span=1.2))
    assert idle >= 2  # about one an interval while it has nothing else to say
    assert answers > 0
    assert busy <= 1  # its answers are its sign of life (one may fall at the switch)


def test_a_worker_keeps_the_automatic_interval_the_controller_computes():
    """No interval set: the worker's rounds are RunConfig.heartbeat_interval's, here a third
    of a 0.6-s timeout (0.2 s), not the 1 s of a small run with the default timeout."""
    idle, busy, _ = asyncio.run(_heartbeats_idle_then_busy(interval=None, span=1.2, timeout=0.6))
    assert 4 <= idle <= 8  # about one each 0.2 s over 1.2 s (1 s rounds would send 1 or 2)
    assert busy <= 1


async def _register_with(reply: Shutdown | None) -> tuple[int, Register]:
    """An EchoWorker registering at a bare ROUTER that answers `reply` (None: nothing):
    (its exit code, the Register it sent)."""
    async with _serving(EchoWorker, "echo-0") as (channel, _, serving):
        identity, register = await asyncio.wait_for(channel.recv(), 10)
        if reply is not None:
            await channel.send(identity, reply)
        return await asyncio.wait_for(serving, 30), register


def test_a_refused_or_unanswered_registration_exits_1_and_says_why(monkeypatch, caplog):
    """The worker states this release's protocol; a refusal's reason, or the likely causes
    of silence (CurveZMQ keys, a controller of an earlier release), go to its log."""
    monkeypatch.setattr("areal.workers.base.REGISTER_TIMEOUT_S", 0.5)
    with caplog.at_level("ERROR", logger="areal.workers.base"):
        code, register = asyncio.run(
            _register_with(Shutdown(reason="registration refused: wrong secret"))
        )
        assert code == 1 and register.protocol == PROTOCOL_VERSION
        assert "controller refused registration: registration refused: wrong secret" in caplog.text
        code, _ = asyncio.run(_register_with(None))
    assert code == 1
    silent = caplog.records[-1].getMessage()
    assert "no answer from the controller" in silent and "within 0 s" in silent
    assert "pass --keys DIR" in silent and "a controller of an earlier areal release" in silent
