"""The worker life cycle over a real socket: register, set up, serve, and the exit code a
Shutdown leads to (a launcher restarts a worker that exits with REJOIN_EXIT_CODE)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import zmq.asyncio

from areal.config import config_to_dict, load_config
from areal.messages import REJOIN_EXIT_CODE, Ready, Register, Shutdown, Welcome, WorkerKind
from areal.transport import RouterChannel
from areal.workers.base import Worker


class EchoWorker(Worker):
    kind = WorkerKind.REWARD

    async def setup(self, welcome: Welcome) -> int:
        return welcome.version

    async def handle(self, msg: Any) -> None:
        pass


@pytest.mark.parametrize("rejoin, code", [(False, 0), (True, REJOIN_EXIT_CODE)])
def test_shutdown_exit_code_says_whether_to_start_the_worker_again(rejoin, code):
    async def scenario() -> tuple[int, list[type], int]:
        ctx = zmq.asyncio.Context()
        channel = RouterChannel(ctx, "127.0.0.1", 0)
        worker = EchoWorker(channel.address, "echo-0", secret="s")
        serving = asyncio.create_task(worker.serve())
        seen = []
        try:
            identity, msg = await asyncio.wait_for(channel.recv(), 10)
            seen.append(type(msg))
            await channel.send(identity, Welcome(config=config_to_dict(load_config()), version=4))
            while not isinstance(msg, Ready):
                identity, msg = await asyncio.wait_for(channel.recv(), 10)
            seen.append(type(msg))
            await channel.send(identity, Shutdown(reason="test", rejoin=rejoin))
            return await asyncio.wait_for(serving, 10), seen, msg.version
        finally:
            channel.close()
            ctx.term()

    exit_code, seen, version = asyncio.run(scenario())
    assert seen == [Register, Ready] and version == 4
    assert exit_code == code
