"""Who may talk to the controller: CurveZMQ keys, their files, and the ZAP handler.

With `controller.auth` resolved to 'curve', the controller's ROUTER is a CurveZMQ server:
every connection is encrypted, and a peer completes the handshake only if its client
public key is authorised. The check is ZeroMQ's ZAP protocol, answered by `ZapHandler` on
the controller's event loop: a peer that is refused never gets a single message through,
in either direction (it cannot register, send work, or receive data), and the refusal is
logged with the peer's address and key. Peers speaking plain TCP to a CURVE socket fail
the handshake before ZAP; `watch_handshakes` logs those.

Key directory (`python -m areal.auth init DIR`; made fresh per run in `<run_dir>/keys`
when `controller.keys_dir` is null):

    DIR/server.key_secret   controller only: the server key pair
    DIR/server.key          public: copy to every worker node
    DIR/client.key_secret   a client key pair workers may share: copy to worker nodes
    DIR/authorized/*.key    public client keys the controller admits (client.key is one)

`python -m areal.auth add-client DIR NAME` makes a per-node pair instead
(DIR/clients/NAME.key_secret, to copy to that node only; its public half goes into
DIR/authorized/, read again by a running controller for new connections). A worker reads
`server.key` and `client.key_secret` from the directory given by `--keys DIR` (or
$AREAL_KEYS); no other file needs to leave the controller node. Deleting a file from
`authorized/` refuses that key's new connections; restart the controller to drop open ones.

The shared secret of 'secret' mode (Register.secret) is checked in `areal.controller.pool`;
under 'curve' it is checked too when `controller.secret` is set. This module imports only
zmq; it opens no socket of its own except the ZAP handler's inproc one.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.auth import create_certificates, load_certificate, load_certificates
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

SERVER = "server"
CLIENT = "client"
AUTHORIZED = "authorized"
ZAP_DOMAIN = b"areal"
MAX_REFUSED = 100
"""Distinct refused peers logged at WARNING (and kept); the rest only counted."""
KEYS_ENV = "AREAL_KEYS"
"""Environment variable naming a worker's key directory (like --keys)."""
KEYS_TEXT_ENV = "AREAL_CURVE_KEYS"
"""Environment variable holding a worker's keys themselves (`client_keys_text`): for
launchers that start workers on nodes that do not share the controller's file system."""


class KeyFileError(ValueError):
    """A key file is missing or unreadable; the text names the file and the fix."""


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    authorized_dir: Path
    """Directory of the public keys (*.key) of admitted clients."""


@dataclass(frozen=True)
class ClientKeys:
    server_public: bytes
    public: bytes
    secret: bytes


# -- key files ------------------------------------------------------------------------------------


def init_keys(directory: str | Path) -> Path:
    """Create a server pair, one shared client pair, and authorise it; keeps existing keys."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)  # it holds secret keys
    (directory / AUTHORIZED).mkdir(exist_ok=True)
    for name in (SERVER, CLIENT):
        if not (directory / f"{name}.key_secret").is_file():
            create_certificates(directory, name)
            os.chmod(directory / f"{name}.key_secret", 0o600)
    shutil.copyfile(directory / f"{CLIENT}.key", directory / AUTHORIZED / f"{CLIENT}.key")
    return directory


def add_client(directory: str | Path, name: str) -> Path:
    """A new client pair DIR/clients/NAME.key_secret, authorised; returns its path."""
    directory = Path(directory)
    if not (directory / f"{SERVER}.key_secret").is_file():
        raise KeyFileError(
            f"{directory} has no {SERVER}.key_secret; run "
            f"`python -m areal.auth init {directory}` first"
        )
    clients = directory / "clients"
    clients.mkdir(exist_ok=True)
    public, secret = create_certificates(clients, name)
    os.chmod(secret, 0o600)
    shutil.copyfile(public, directory / AUTHORIZED / f"{name}.key")
    return Path(secret)


def run_keys(keys_dir: str | None, run_dir: Path) -> tuple[ServerKeys, Path]:
    """The controller's keys: `keys_dir`, or a fresh set in `<run_dir>/keys`."""
    directory = Path(keys_dir).expanduser() if keys_dir else init_keys(run_dir / "keys")
    return load_server_keys(directory), directory


def load_server_keys(directory: str | Path) -> ServerKeys:
    directory = Path(directory)
    public, secret = _load(directory / f"{SERVER}.key_secret", "the controller's key pair")
    authorized_dir = directory / AUTHORIZED
    if not authorized_dir.is_dir():
        raise KeyFileError(
            f"{authorized_dir} does not exist: no client could be admitted; run "
            f"`python -m areal.auth init {directory}`"
        )
    assert secret is not None  # _load refuses a file without one
    return ServerKeys(public=public, secret=secret, authorized_dir=authorized_dir)


def load_client_keys(directory: str | Path) -> ClientKeys:
    """A worker's keys: DIR/server.key and DIR/client.key_secret."""
    directory = Path(directory)
    server_public, _ = _load(
        directory / f"{SERVER}.key", "the controller's public key", secret=False
    )
    public, secret = _load(directory / f"{CLIENT}.key_secret", "this worker's client key pair")
    assert secret is not None  # _load refuses a file without one
    return ClientKeys(server_public=server_public, public=public, secret=secret)


def client_keys_text(directory: str | Path) -> str:
    """A worker's keys (DIR/server.key, DIR/client.key_secret) as one line of z85 text:
    server public, client public, client secret. Secret: give it only through a process's
    environment, never a command line or a log."""
    keys = load_client_keys(directory)  # z85 already, as the certificate files hold them
    return " ".join(key.decode() for key in (keys.server_public, keys.public, keys.secret))


def client_keys_from_text(text: str) -> ClientKeys:
    """The inverse of `client_keys_text`."""
    parts = text.split()
    if len(parts) != 3 or not all(len(part) == 40 for part in parts):
        raise KeyFileError(
            f"${KEYS_TEXT_ENV} must hold three 40-character z85 keys (server "
            "public, client public, client secret), as the launcher writes them"
        )
    try:
        for part in parts:
            z85.decode(part.encode())
    except (ValueError, KeyError) as err:  # KeyError: a character z85 does not use
        raise KeyFileError(f"${KEYS_TEXT_ENV} is not z85 text: {err!r}") from None
    server_public, public, secret = (part.encode() for part in parts)
    return ClientKeys(server_public=server_public, public=public, secret=secret)


def _load(path: Path, what: str, secret: bool = True) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise KeyFileError(
            f"{path} ({what}) does not exist; keys are made with `python -m "
            "areal.auth init DIR` on the controller node and copied from there "
            "(see areal/auth.py)"
        )
    try:
        public, secret_key = load_certificate(path)
    except (OSError, ValueError) as err:
        raise KeyFileError(f"{path} ({what}) is not a ZeroMQ certificate: {err}") from None
    if secret and secret_key is None:
        raise KeyFileError(f"{path} ({what}) holds no secret key")
    return public, secret_key


# -- sockets ---------------------------------------------------------------------------------------


def make_server(socket: zmq.Socket, keys: ServerKeys) -> None:
    """Turn a socket (before bind) into a CURVE server that asks ZAP about every peer."""
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_server = True
    socket.zap_domain = ZAP_DOMAIN


def make_client(socket: zmq.Socket, keys: ClientKeys) -> None:
    """Turn a socket (before connect) into a CURVE client of the controller."""
    socket.curve_serverkey = keys.server_public
    socket.curve_publickey = keys.public
    socket.curve_secretkey = keys.secret


@dataclass
class ZapHandler:
    """Answers ZAP requests on the event loop: CURVE clients with an authorised key pass;
    everything else is refused and logged (once per address and key at WARNING, repeats
    at DEBUG: a refused peer keeps reconnecting)."""

    ctx: zmq.asyncio.Context
    keys: ServerKeys
    refused: list[dict[str, str]] = field(default_factory=list)
    """One entry per distinct refused (address, mechanism, key), the first MAX_REFUSED."""
    _authorized: frozenset[bytes] = frozenset()
    _loaded_mtime: float = -1.0

    def authorized(self) -> frozenset[bytes]:
        """z85 keys in the authorised directory, re-read when it changes (a key added with
        `add-client` admits new connections without a restart)."""
        mtime = self.keys.authorized_dir.stat().st_mtime
        if mtime != self._loaded_mtime:
            self._authorized = frozenset(load_certificates(self.keys.authorized_dir))
            self._loaded_mtime = mtime
        return self._authorized

    def __post_init__(self) -> None:
        # ZAP is a REP socket at this fixed inproc address of the context (RFC 27); it must
        # exist before the server socket binds.
        self.socket = self.ctx.socket(zmq.REP)
        self.socket.linger = 0
        self.socket.bind("inproc://zeromq.zap.01")

    async def serve(self) -> None:
        try:
            while True:
                request = await self.socket.recv_multipart()
                await self.socket.send_multipart(self._answer(request))
        finally:
            self.socket.close(0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6:
            return [
                b"1.0",
                request[1] if len(request) > 1 else b"",
                b"400",
                b"bad request",
                b"",
                b"",
            ]
        version, request_id, domain, address, _identity, mechanism = request[:6]
        credentials = request[6:]
        key = z85.encode(credentials[0]) if mechanism == b"CURVE" and credentials else b""
        if domain == ZAP_DOMAIN and mechanism == b"CURVE" and key in self.authorized():
            return [version, request_id, b"200", b"OK", key, b""]
        self._refuse(
            address.decode(errors="replace"), mechanism.decode(errors="replace"), key.decode()
        )
        return [version, request_id, b"400", b"not authorised", b"", b""]

    def _refuse(self, address: str, mechanism: str, key: str) -> None:
        entry = {"address": address, "mechanism": mechanism, "key": key}
        if entry in self.refused or len(self.refused) >= MAX_REFUSED:
            # A refused peer keeps reconnecting, or makes a new key each time: log it once.
            log.debug("refused %s again (%s key %s)", address, mechanism, key or "-")
            return
        self.refused.append(entry)
        log.warning(
            "refused a connection from %s: %s key %s is not authorised (add its public "
            "key to the controller's authorized/ directory to admit it)",
            address,
            mechanism,
            key or "-",
        )


async def watch_handshakes(socket: zmq.Socket, failures: list[str]) -> None:
    """Log peers whose handshake failed before ZAP (e.g. plain TCP against CURVE); `failures`
    collects each distinct reason once."""
    events = (
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    )
    monitor = socket.get_monitor_socket(events)
    try:
        while True:
            # an asyncio socket's monitor is an asyncio socket (pyzmq's stubs say otherwise)
            event = parse_monitor_message(await monitor.recv_multipart())  # type: ignore[misc]
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                continue  # ZapHandler logged it with the peer's key
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # value: an errno
                reason = f"no detail: {os.strerror(event['value'])}"
            else:
                reason = _protocol_reason(event["value"])
            if reason not in failures:  # a refused peer keeps reconnecting: log once
                failures.append(reason)
                log.warning(
                    "refused a connection on %s: handshake failed (%s); peers must "
                    "use CurveZMQ with the controller's server key",
                    event["endpoint"].decode(errors="replace"),
                    reason,
                )
    finally:
        socket.disable_monitor()
        monitor.close(0)


def _protocol_reason(value: int) -> str:
    for name in dir(zmq):
        if name.startswith("PROTOCOL_ERROR_") and getattr(zmq, name) == value:
            return name.removeprefix("PROTOCOL_ERROR_").lower()
    return f"code {value}"


# -- command line ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m areal.auth",
        description="CurveZMQ keys for a controller and its remote workers (see the module doc).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="server key pair + a shared, authorised client pair")
    init.add_argument("directory")
    add = sub.add_parser("add-client", help="a new authorised client pair for one node")
    add.add_argument("directory")
    add.add_argument("name")
    args = parser.parse_args(argv)
    try:
        if args.command == "init":
            directory = init_keys(args.directory)
            print(
                f"keys in {directory}: copy {directory / 'server.key'} and "
                f"{directory / 'client.key_secret'} to each worker node (into one "
                "directory, passed as --keys DIR); server.key_secret never leaves this node"
            )
        else:
            path = add_client(args.directory, args.name)
            print(
                f"client key {path}: copy it to that node as client.key_secret, next to "
                f"{Path(args.directory) / 'server.key'}"
            )
    except KeyFileError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
