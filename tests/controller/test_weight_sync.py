"""Weight synchronisation, one implementation per mode (weight_sync.py, weights_group.py):
what each decides to send to joining workers, on a new version, on a chunk, and after a
failed load; read from the Outbox, no socket."""

from __future__ import annotations

import numpy as np
import pytest

from decisions import SECRET, Decisions, config

from areal.controller.outbox import Outbox
from areal.controller.weight_retry import MAX_FAILURES
from areal.messages import (
    BroadcastWeights,
    GroupName,
    GroupState,
    GroupStatus,
    JoinGroup,
    Register,
    Tensor,
    Trained,
    UpdateWeights,
    Welcome,
    WeightsChunk,
    WeightsUpdated,
    WorkerKind,
)
from registers import register


def _decisions(tmp_path, mode: str) -> Decisions:
    return Decisions(config(tmp_path, f"weight_sync.mode={mode}"), tmp_path)


def _version_dir(tmp_path, version: int) -> str:
    path = tmp_path / "weights" / f"v{version:06d}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"x")
    return str(path)


def _publish(run: Decisions, version: int, members=(), **fields) -> Outbox:
    out = Outbox()
    run.core.weights.publish(
        Trained(step=version, version=version, stats={}, **fields), list(members), out
    )
    return out


def test_disk_mode_announces_each_version_and_a_joining_worker_loads_the_newest(tmp_path):
    run = _decisions(tmp_path, "disk")
    first = run.join(WorkerKind.ROLLOUT)
    v1, v2 = _version_dir(tmp_path, 1), _version_dir(tmp_path, 2)
    out = _publish(run, 1, weights_path=v1)
    (update,) = out.sent(UpdateWeights)
    assert update.version == 1 and update.path == v1 and update.mode == "disk"
    _publish(run, 2, weights_path=v2)
    (welcome,) = run.on(b"late", _register(WorkerKind.ROLLOUT, "rollout-1")).sent(Welcome)
    assert (welcome.version, welcome.weights_path) == (2, v2)
    # version 2's directory deleted: a joining worker gets the newest there is
    for f in (tmp_path / "weights" / "v000002").iterdir():
        f.unlink()
    (welcome,) = run.on(b"later", _register(WorkerKind.ROLLOUT, "rollout-2")).sent(Welcome)
    assert (welcome.version, welcome.weights_path) == (1, v1)
    trainer_welcome = run.on(b"t", _register(WorkerKind.TRAINER, "trainer-0")).sent(Welcome)[0]
    assert trainer_welcome.weights_path is None  # a trainer loads its checkpoint instead
    assert first.version == 0


def test_a_failed_load_is_retried_with_the_newest_loadable_version_then_the_worker_lost(tmp_path):
    run = _decisions(tmp_path, "disk")
    worker = run.join(WorkerKind.ROLLOUT)
    v1 = _version_dir(tmp_path, 1)
    _publish(run, 1, weights_path=v1)
    run.on(worker.identity, WeightsUpdated(version=1))
    _publish(run, 2, weights_path=str(tmp_path / "weights" / "v000002"))  # never written
    run.on(worker.identity, WeightsUpdated(version=2, error="no such file"))
    out = Outbox()
    assert run.core.weights.retry(out) == []
    assert not out.messages  # it serves v1, the newest loadable: nothing newer to send
    assert not run.core.weights.retries.failing
    for _ in range(MAX_FAILURES):
        run.on(worker.identity, WeightsUpdated(version=2, error="corrupt"))
    lost = run.core.weights.retry(Outbox())
    assert [(h.worker_id, why.split(" (")[0]) for h, why in lost] == [
        ("rollout-0", "could not load weights")
    ]


def test_stream_mode_relays_chunks_keeps_them_for_late_joiners_and_resends_them(tmp_path):
    run = _decisions(tmp_path, "stream")
    worker = run.join(WorkerKind.ROLLOUT)
    trainer = run.join(WorkerKind.TRAINER)
    out = _publish(run, 1, num_chunks=2)
    (update,) = out.sent(UpdateWeights)
    assert update.mode == "stream" and update.num_chunks == 2
    chunks = [
        WeightsChunk(
            version=1, index=i, num_chunks=2, names=["w"], tensors=[Tensor(np.zeros(2, np.float32))]
        )
        for i in range(2)
    ]
    for chunk in chunks:
        relayed = run.on(trainer.identity, chunk)
        assert relayed.messages == [(worker.identity, chunk)]
    late = run.on(b"late", _register(WorkerKind.ROLLOUT, "rollout-1"))
    assert [type(m).__name__ for m in late.sent()] == [
        "Welcome",
        "UpdateWeights",
        "WeightsChunk",
        "WeightsChunk",
    ]
    assert late.sent(UpdateWeights)[0].num_chunks == 2
    run.on(worker.identity, WeightsUpdated(version=1, error="bad chunk"))
    out = Outbox()
    run.core.weights.retry(out)
    assert [type(m).__name__ for m in out.sent()] == [
        "UpdateWeights",
        "WeightsChunk",
        "WeightsChunk",
    ]
    assert _publish(run, 2, num_chunks=1) and run.core.weights.chunks == []


def test_collective_mode_reforms_its_group_only_when_members_change_or_fail(tmp_path):
    run = _decisions(tmp_path, "collective")
    trainer = run.join(WorkerKind.TRAINER)
    run.core.trainers.group.store = "127.0.0.1:29500"
    workers = [run.join(WorkerKind.ROLLOUT, i) for i in range(2)]
    weights = run.core.weights
    members = [h.identity for h in weights.candidates()]
    assert members == [w.identity for w in workers]
    manifest = [{"num_bytes": 8, "tensors": []}]
    out = _publish(run, 1, members=members, manifest=manifest)
    joins = out.sent(JoinGroup)
    assert [(j.rank, j.world_size, j.group) for j in joins] == [
        (0, 3, GroupName.WEIGHTS),
        (1, 3, GroupName.WEIGHTS),
        (2, 3, GroupName.WEIGHTS),
    ]
    assert out.messages[0][0] == trainer.identity
    assert [type(m).__name__ for m in out.sent()[3:]] == [
        "UpdateWeights",
        "UpdateWeights",
        "BroadcastWeights",
    ]
    # the same members: no new group
    out = _publish(run, 2, members=members)
    assert not out.sent(JoinGroup) and out.sent(BroadcastWeights)[0].generation == 1
    # a member reports the broadcast failed: re-formed and broadcast again at the tick
    run.on(
        workers[1].identity,
        GroupStatus(
            group=GroupName.WEIGHTS, generation=1, state=GroupState.FAILED, error="peer died"
        ),
    )
    assert weights.tick_candidates()
    out = Outbox()
    weights.tick(members[:1], out)
    assert out.sent(JoinGroup)[0].world_size == 2 and weights.generation == 2
    assert out.sent(BroadcastWeights)[0].version == 2 and not weights.tick_candidates()
    # a rollout worker that becomes ready late gets the group re-formed before any work
    late = run.on(b"late", _register(WorkerKind.ROLLOUT, "rollout-2"))
    assert late.sent(Welcome)
    handle = run.pool.get(b"late")
    assert weights.candidates(joining=handle)[-1] is handle


def test_shm_mode_announces_slots_and_sends_the_newest_to_joining_and_failing_workers(tmp_path):
    run = _decisions(tmp_path, "shm")
    worker = run.join(WorkerKind.ROLLOUT)
    slots = [str(tmp_path / "shm" / f"slot-{i}.bin") for i in range(2)]
    (update,) = _publish(run, 1, weights_path=slots[1]).sent(UpdateWeights)
    assert (update.mode, update.version, update.path) == ("shm", 1, slots[1])
    run.on(worker.identity, WeightsUpdated(version=1))
    _publish(run, 2, weights_path=slots[0])
    (welcome,) = run.on(b"late", _register(WorkerKind.ROLLOUT, "rollout-1")).sent(Welcome)
    assert (welcome.version, welcome.weights_path) == (2, slots[0])
    trainer_welcome = run.on(b"t", _register(WorkerKind.TRAINER, "trainer-0")).sent(Welcome)[0]
    assert trainer_welcome.weights_path is None
    run.on(worker.identity, WeightsUpdated(version=2, error="slot being overwritten"))
    out = Outbox()
    assert run.core.weights.retry(out) == []
    (again,) = out.sent(UpdateWeights)  # the newest version's slot, not an older one
    assert (again.mode, again.version, again.path) == ("shm", 2, slots[0])


def test_a_chunk_is_refused_outside_stream_mode(tmp_path):
    run = _decisions(tmp_path, "disk")
    assert run.core.weights.on_chunk(
        WeightsChunk(version=1, index=0, num_chunks=1, names=[], tensors=[]), Outbox()
    )


@pytest.mark.parametrize("mode", ["disk", "stream", "collective", "shm"])
def test_after_a_resume_every_mode_serves_the_checkpoint_until_a_new_version(tmp_path, mode):
    run = _decisions(tmp_path, mode)
    checkpoint = tmp_path / "checkpoints" / "step_3" / "weights"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"x")
    run.core.weights.restore(3, str(checkpoint))
    (welcome,) = run.on(b"r", _register(WorkerKind.ROLLOUT, "rollout-0")).sent(Welcome)
    assert (welcome.version, welcome.weights_path) == (3, str(checkpoint))
    path = {"disk": _version_dir(tmp_path, 4), "shm": str(tmp_path / "slot-0.bin")}.get(mode)
    _publish(run, 4, weights_path=path)
    (welcome,) = run.on(b"r2", _register(WorkerKind.ROLLOUT, "rollout-1")).sent(Welcome)
    assert welcome.version == 4 and welcome.weights_path == path


def _register(kind: WorkerKind, worker_id: str) -> Register:
    return register(kind, worker_id, SECRET)
