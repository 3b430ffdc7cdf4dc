"""Who may talk to the controller: key files, the ZAP handler, registration rules.

Real sockets, no controller run: a ROUTER set up as the controller sets it up (CurveZMQ
server, ZAP handler on the event loop), and DEALER peers with and without keys. The full
run with remote workers and intruders is tests/controller/test_distributed_run.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import stat
import subprocess
import sys

import pytest
import zmq
import zmq.asyncio
import zmq.auth

from areal.auth import (
    KeyFileError,
    ZapHandler,
    add_client,
    init_keys,
    load_client_keys,
    load_server_keys,
    watch_handshakes,
)
from areal.config import ConfigError, load_config
from areal.controller.pool import WorkerHandle, WorkerPool
from areal.codec import decode, encode
from areal.messages import Heartbeat, Register, WorkerKind
from areal.transport import RouterChannel
from refusals import is_plain_peer_refusal
from registers import register


def test_init_writes_private_secrets_and_authorises_the_shared_client(tmp_path):
    keys = init_keys(tmp_path / "keys")
    assert sorted(p.name for p in keys.iterdir()) == [
        "authorized",
        "client.key",
        "client.key_secret",
        "server.key",
        "server.key_secret",
    ]
    assert [p.name for p in (keys / "authorized").iterdir()] == ["client.key"]
    for name in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE((keys / name).stat().st_mode) == 0o600
    server, client = load_server_keys(keys), load_client_keys(keys)
    assert client.server_public == server.public
    before = (keys / "server.key_secret").read_bytes()
    init_keys(keys)  # idempotent: a second init keeps the keys workers already hold
    assert (keys / "server.key_secret").read_bytes() == before


def test_missing_key_files_are_named_with_the_fix(tmp_path):
    with pytest.raises(KeyFileError, match=r"server\.key .*python -m areal.auth init"):
        load_client_keys(tmp_path)
    with pytest.raises(KeyFileError, match="run `python -m areal.auth init"):
        add_client(tmp_path, "node1")


async def _exchange(address: str, curve, server_public: bytes | None) -> list:
    """A peer registers and waits briefly for anything back."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    got = []
    try:  # closed also when it fails: a context left to the garbage collector can hang
        if curve is not None:
            sock.curve_serverkey = server_public
            sock.curve_publickey, sock.curve_secretkey = curve
        sock.connect(address)
        await sock.send_multipart(encode(register(WorkerKind.ROLLOUT, "w", "")))
        while await sock.poll(1500):
            got.append(decode(await sock.recv_multipart()))
    finally:
        sock.close(0)
        ctx.term()
    return got


async def _answer_everyone(channel: RouterChannel, seen: list) -> None:
    """Answer every message with a Heartbeat, remembering who got through."""
    while True:
        identity, msg = await channel.recv()
        seen.append(msg)
        await channel.send(identity, Heartbeat())


@pytest.mark.slow
def test_only_authorised_keys_get_through_and_refusals_are_logged(tmp_path, caplog):
    keys = init_keys(tmp_path / "keys")
    client = load_client_keys(keys)

    async def scenario():
        ctx = zmq.asyncio.Context()
        zap = ZapHandler(ctx, load_server_keys(keys))
        channel = RouterChannel(ctx, "127.0.0.1", 0, curve=load_server_keys(keys))
        failures: list[str] = []
        seen: list = []
        tasks = [
            asyncio.create_task(zap.serve()),
            asyncio.create_task(watch_handshakes(channel.socket, failures)),
            asyncio.create_task(_answer_everyone(channel, seen)),
        ]
        try:
            ok = await _exchange(
                channel.address, (client.public, client.secret), client.server_public
            )
            stranger = await _exchange(channel.address, zmq.curve_keypair(), client.server_public)
            plain = await _exchange(channel.address, None, None)
            # A key added while running admits new connections without a restart.
            added = zmq.auth.load_certificate(add_client(keys, "node7"))
            late = await _exchange(channel.address, added, client.server_public)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            channel.close()
            ctx.term()
        return ok, stranger, plain, late, seen, zap, failures

    with caplog.at_level(logging.WARNING, logger="areal.auth"):
        ok, stranger, plain, late, seen, zap, failures = asyncio.run(scenario())
    assert [type(m) for m in ok] == [Heartbeat] and [type(m) for m in late] == [Heartbeat]
    assert stranger == [] and plain == []
    assert [type(m) for m in seen] == [Register, Register]  # only the two authorised peers
    assert [r["mechanism"] for r in zap.refused] == ["CURVE"]
    assert failures and all(map(is_plain_peer_refusal, failures)), failures
    logged = caplog.text
    assert "is not authorised" in logged and zap.refused[0]["key"] in logged
    assert f"handshake failed ({failures[0]})" in logged


def test_worker_command_line_needs_credentials(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("AREAL_SECRET", "AREAL_KEYS")}
    result = subprocess.run(
        [sys.executable, "-m", "areal.workers.reward", "--connect", "tcp://127.0.0.1:1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "pass --keys DIR (CurveZMQ) or set $AREAL_SECRET" in result.stderr
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal.workers.reward",
            "--connect",
            "tcp://127.0.0.1:1",
            "--keys",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "server.key" in result.stderr


def test_auth_resolution_and_remote_configuration_rules():
    cfg = load_config()
    assert not cfg.controller.uses_curve  # loopback, local workers: the secret suffices
    assert load_config(overrides=["controller.host=0.0.0.0"]).controller.uses_curve
    assert load_config(overrides=["controller.remote_kinds=[rollout]"]).controller.uses_curve
    with pytest.raises(ConfigError, match="needs a controller.secret"):
        load_config(overrides=["controller.remote_kinds=[trainer]", "controller.auth=secret"])
    with pytest.raises(ConfigError, match="'gpu' is not one of rollout, reward, trainer"):
        load_config(overrides=["controller.remote_kinds=[gpu]"])
    with pytest.raises(ConfigError, match="trainer.cpus lists 1 CPU sets for trainer.num_ranks=2"):
        load_config(overrides=["trainer.num_ranks=2", "trainer.cpus=[0-3]"])
    with pytest.raises(ConfigError, match="rollout.cpus: '3-1' is not a CPU list"):
        load_config(overrides=["rollout.cpus=[3-1]"])


def _register(pool: WorkerPool, identity: bytes, worker_id: str, rank: int):
    return pool.register(
        identity,
        register(WorkerKind.TRAINER, worker_id, "", rank=rank),
    )


def test_trainer_ranks_are_unique_and_in_range(tmp_path):
    pool = WorkerPool(
        load_config(overrides=["trainer.num_ranks=2"]), tmp_path, "tcp://x:1", secret=None
    )
    assert isinstance(_register(pool, b"a", "trainer-a", 0), WorkerHandle)
    assert _register(pool, b"b", "trainer-b", 0) == "trainer rank 0 is held by trainer-a"
    assert _register(pool, b"c", "trainer-c", 2) == (
        "trainer rank 2 outside 0..1 (trainer.num_ranks=2)"
    )
    assert isinstance(_register(pool, b"d", "trainer-d", 1), WorkerHandle)
    assert pool.refused == ["trainer-b", "trainer-c"]


def test_a_worker_restarted_during_setup_replaces_its_earlier_registration(tmp_path):
    pool = WorkerPool(load_config(), tmp_path, "tcp://x:1", secret=None)
    first = _register(pool, b"t0", "trainer-0", 0)
    second = _register(pool, b"t0", "trainer-0", 0)  # not ready yet: it restarted
    assert isinstance(second, WorkerHandle) and pool.get(b"t0") is second and first.identity is None
    assert pool.lost(timeout_s=0.0) == []  # still setting up: silence does not count yet
    second.ready = True
    assert _register(pool, b"t0", "trainer-0", 0) == (  # a ready one is never replaced
        "a second registration of trainer-0, which is ready"
    )
    assert pool.lost(timeout_s=0.0) == [second]  # silence counts once a worker is ready


def test_client_keys_travel_as_one_line_of_text_and_bad_text_is_named(tmp_path):
    """What a launcher puts in a worker's environment ($AREAL_CURVE_KEYS) on a node that
    does not share the controller's files: the same keys as the directory holds."""
    from areal.auth import KEYS_TEXT_ENV, client_keys_from_text, client_keys_text

    keys_dir = init_keys(tmp_path / "keys")
    text = client_keys_text(keys_dir)
    assert len(text.split()) == 3 and "\n" not in text
    assert client_keys_from_text(text) == load_client_keys(keys_dir)
    for bad in ("", text.split()[0], text.replace(text[5], "\x7f", 1)):
        with pytest.raises(KeyFileError, match=re.escape(f"${KEYS_TEXT_ENV}")):
            client_keys_from_text(bad)
