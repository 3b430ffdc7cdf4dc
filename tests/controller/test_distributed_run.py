"""Remote workers, two trainer ranks and collective weights, as real processes over CurveZMQ.

One run, driven through the embedding API: the controller starts only the reward worker;
two trainer ranks and two rollout workers are separate processes started here with
`python -m areal.workers.<kind> --connect tcp://HOST:PORT --keys DIR`, as on other nodes.
The keys come from `python -m areal.auth init`. Weights reach the rollout workers by the
collective broadcast. While the run trains, the test
- connects peers without an authorised key (plain TCP; CURVE with an unknown key), which
  try to register, send results and wait for data;
- starts a third rollout worker late and, once it serves the current version, kills one of
  the first two (kill -9), so the weights group is re-formed twice;
- stops the run (Controller.stop) once the lost worker was detected and a few more steps
  trained, so that every event happens whatever the machine's speed.
The task (tests/controller/letter_task.py) is one a random tiny model learns in a few steps.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.asyncio

from areal.auth import load_client_keys
from areal.config import load_config
from areal.controller import Controller
from areal.codec import encode
from areal.messages import FinishReason, Generated, Trained, WorkerKind
from refusals import is_plain_peer_refusal
from registers import register

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
MIN_STEPS, MAX_STEPS, BATCH, GROUP = 10, 400, 16, 4
"""MAX_STEPS only bounds a run whose stop condition never comes: a late worker takes ~15 s
to start, and a step of this task takes well under a second."""


def _config(run_dir: Path, model_dir: str, keys: Path, port: int):
    return load_config(
        overrides=[
            f"model.path={model_dir}",
            f"run_dir={run_dir}",
            "task.name=letter_task:LetterTask",
            f"trainer.total_steps={MAX_STEPS}",
            f"trainer.batch_size={BATCH}",
            f"task.group_size={GROUP}",
            "trainer.num_ranks=2",
            "rollout.num_workers=2",
            "trainer.lr=1e-2",
            "rollout.max_new_tokens=16",
            "eval.every_steps=0",
            "eval.temperature=1.0",
            "eval.num_samples=4",
            "weight_sync.mode=collective",
            "weight_sync.timeout_s=20",
            "logging.progress=false",
            "logging.tensorboard=false",
            "controller.heartbeat_interval_s=0.5",
            "controller.heartbeat_timeout_s=10",
            f"controller.port={port}",
            f"controller.keys_dir={keys}",
            "controller.remote_kinds=[rollout,trainer]",
        ]
    )


class RemoteWorkers:
    """Worker processes this test starts, as a user would on other nodes."""

    def __init__(self, address: str, keys: Path, logs: Path) -> None:
        self.address, self.keys, self.logs = address, keys, logs
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {k: v for k, v in os.environ.items() if k not in ("AREAL_SECRET", "AREAL_KEYS")}

    def start(self, kind: str, name: str, rank: int) -> None:
        with open(self.logs / f"{name}.log", "wb") as out:
            self.procs[name] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    f"areal.workers.{kind}",
                    "--connect",
                    self.address,
                    "--keys",
                    str(self.keys),
                    "--worker-id",
                    name,
                    "--rank",
                    str(rank),
                ],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def stop(self) -> None:
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def _intrude(address: str, keys: Path) -> dict[str, list]:
    """Peers without an authorised key try to register, send results and read anything."""
    ctx = zmq.asyncio.Context()
    received: dict[str, list] = {}
    stranger = zmq.curve_keypair()
    trusted_server = load_client_keys(keys).server_public
    try:  # closed also when it fails: a context left to the garbage collector can hang
        for name in ("plain", "unknown-key"):
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            if name == "unknown-key":
                sock.curve_serverkey = trusted_server
                sock.curve_publickey, sock.curve_secretkey = stranger
            sock.connect(address)
            for msg in (
                register(WorkerKind.ROLLOUT, f"intruder-{name}", "", host="evil"),
                Generated(
                    request_id="x",
                    output_ids=np.zeros(3, np.int32),
                    logprobs=np.zeros(3, np.float32),
                    versions=np.zeros(3, np.int32),
                    finish_reason=FinishReason.STOP,
                ),
                Trained(step=1, version=99, stats={"loss": 0.0}),
            ):
                await sock.send_multipart(encode(msg))
            received[name] = []
            while await sock.poll(3000):
                received[name].append(await sock.recv_multipart())
            sock.close(0)
    finally:
        ctx.destroy(linger=0)  # closes a socket a failure left open, then terminates
    return received


async def _drive(cfg, keys: Path, logs: Path) -> dict:
    ctl = Controller(cfg)
    run = asyncio.create_task(ctl.run())
    address = f"tcp://127.0.0.1:{cfg.controller.port}"
    workers = RemoteWorkers(address, keys, logs)
    for rank in range(2):
        workers.start("trainer", f"trainer-{rank}", rank)
        workers.start("rollout", f"rollout-{rank}", rank)
    records, out = [], {"ctl": ctl}
    killed_at = None
    try:
        async for record in ctl.events():
            records.append(record)
            if record["kind"] != "step":
                continue
            step = record["step"]
            if step == 2:
                out["intruders"] = await _intrude(address, keys)
                workers.start("rollout", "rollout-2", 2)  # a late joiner
            late = [
                h for h in ctl.core.pool.ready(WorkerKind.ROLLOUT) if h.worker_id == "rollout-2"
            ]
            # It starts from the model directory (version 0): any later version reached it
            # by broadcast after it joined.
            if killed_at is None and late and late[0].version > 0:
                os.kill(workers.procs["rollout-1"].pid, signal.SIGKILL)
                killed_at = step
            lost = any(r.get("event") == "worker_lost" for r in records)
            if killed_at and lost and step >= max(MIN_STEPS, killed_at + 3):
                ctl.stop()
        out["summary"] = await run
    finally:
        if not run.done():
            run.cancel()
        await asyncio.to_thread(workers.stop)
    out["records"] = records
    return out


@pytest.fixture(scope="module")
def remote_run(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("remote")
    keys = root / "keys"
    made = subprocess.run(
        [sys.executable, "-m", "areal.auth", "init", str(keys)], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    with pytest.MonkeyPatch.context() as mp:
        # The task module must import in this process and in the local reward worker.
        mp.syspath_prepend(str(HERE))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        logs = root / "remote-logs"
        logs.mkdir()
        cfg = _config(root / "run", tiny_model_dir, keys, port)
        try:
            return asyncio.run(_drive(cfg, keys, logs))
        except BaseException:
            for log in sorted(logs.glob("*.log")):
                print(f"--- {log.name}\n{log.read_text()[-3000:]}")
            raise


def _steps(run) -> list[dict]:
    return [r for r in run["records"] if r["kind"] == "step"]


def _events(run, name: str) -> list[dict]:
    return [r for r in run["records"] if r["kind"] == "event" and r["event"] == name]


def test_run_with_remote_ranks_and_rollouts_completes_and_learns(remote_run):
    summary = remote_run["summary"]
    num_steps = summary["steps"]
    assert MIN_STEPS <= num_steps < MAX_STEPS and summary["final_version"] == num_steps
    steps = _steps(remote_run)
    assert [r["step"] for r in steps] == list(range(1, num_steps + 1))
    assert all(r["train/num_ranks"] == 2.0 for r in steps)
    assert len(_events(remote_run, "trainer_group_joined")) == 2
    evals = [r for r in remote_run["records"] if r["kind"] == "eval"]
    before, after = evals[0]["eval/reward_mean"], evals[-1]["eval/reward_mean"]
    first = np.mean([r["rollout/reward_mean"] for r in steps[:3]])
    last = np.mean([r["rollout/reward_mean"] for r in steps[-3:]])
    assert after > before + 0.3 and last > first + 0.3, (before, after, first, last)


def test_collective_weights_are_exact_and_survive_a_lost_and_a_late_rollout_worker(remote_run):
    ctl, steps = remote_run["ctl"], _steps(remote_run)
    # Tokens sampled by broadcast weights have the trainer's own log-probs: the rollout
    # workers hold exactly the trainer's tensors (a wrong bit would show here).
    fresh = [r["train/logprob_diff_fresh"] for r in steps[1:] if "train/logprob_diff_fresh" in r]
    assert fresh and max(fresh) < 1e-5, fresh
    lost = _events(remote_run, "worker_lost")
    assert [e["worker_id"] for e in lost] == ["rollout-1"]
    joined = _events(remote_run, "weights_group_joined")
    assert {e["worker_id"] for e in joined} >= {"trainer-0", "rollout-0", "rollout-1", "rollout-2"}
    assert ctl.core.weights.generation >= 2 and ctl.core.weights.num_reformed >= 1
    rollouts = {
        h.worker_id: h for h in ctl.core.pool.by_identity.values() if h.kind is WorkerKind.ROLLOUT
    }
    assert sorted(rollouts) == ["rollout-0", "rollout-2"]
    # Both, the late joiner included, served the final version (the last evaluation ran on it).
    final = remote_run["summary"]["final_version"]
    assert all(h.version == final for h in rollouts.values()), {
        k: h.version for k, h in rollouts.items()
    }


def test_peers_without_the_key_get_nothing_in_and_nothing_out(remote_run):
    ctl = remote_run["ctl"]
    intruders = remote_run["intruders"]
    assert intruders == {"plain": [], "unknown-key": []}, repr(intruders)  # received nothing
    assert ctl.core.pool.refused == []  # their Register never reached the controller's logic
    assert not [h for h in ctl.core.pool.by_identity.values() if "intruder" in h.worker_id]
    assert ctl.core.num_malformed == 0
    # Refusals are logged by the controller: ZAP for the unknown key, the handshake monitor
    # for the plain-TCP peer.
    assert [r["mechanism"] for r in ctl.runtime.zap.refused] == ["CURVE"]
    assert ctl.runtime.handshake_failures, "the plain-TCP peer's refusal was not logged"
    assert all(map(is_plain_peer_refusal, ctl.runtime.handshake_failures)), (
        ctl.runtime.handshake_failures
    )
