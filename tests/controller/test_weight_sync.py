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
    Ready,
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


@pytest.mark.parametrize("mode", ["disk", "shm"])
def test_a_worker_ready_behind_the_version_in_force_is_sent_the_newest(tmp_path, mode):
    """Versions published while a worker set up were announced to the workers ready then,
    and the weights its Welcome named may be gone before it loaded them (it is then ready
    at version 0): once ready, it is sent the newest before any Generate."""
    run = _decisions(tmp_path, mode)
    paths = {v: _version_dir(tmp_path, v) for v in (1, 2)}
    if mode == "shm":
        paths = {v: str(tmp_path / "shm" / f"slot-{v % 2}.bin") for v in (1, 2)}
    _publish(run, 1, weights_path=paths[1])
    (welcome,) = run.on(b"late", _register(WorkerKind.ROLLOUT, "rollout-1")).sent(Welcome)
    assert welcome.version == 1
    _publish(run, 2, weights_path=paths[2])  # while it sets up: not announced to it
    for served in (1, 0):  # it loaded its Welcome's version, or found it gone
        ready = run.on(b"late", Ready(version=served))
        (update,) = ready.sent(UpdateWeights)
        assert (update.version, update.path, update.mode) == (2, paths[2], mode)
        run.pool.get(b"late").ready = False  # the same Ready once more
    on_time = run.on(b"t", _register(WorkerKind.ROLLOUT, "rollout-2"))
    assert on_time.sent(Welcome)[0].version == 2
    assert not run.on(b"t", Ready(version=2)).sent(UpdateWeights)  # it serves the newest


def test_stream_mode_sends_a_ready_worker_only_a_version_its_welcome_did_not_bring(tmp_path):
    run = _decisions(tmp_path, "stream")
    trainer = run.join(WorkerKind.TRAINER)

    def publish(version: int) -> None:
        _publish(run, version, num_chunks=1)
        chunk = WeightsChunk(
            version=version,
            index=0,
            num_chunks=1,
            names=["w"],
            tensors=[Tensor(np.zeros(2, np.float32))],
        )
        run.on(trainer.identity, chunk)

    publish(1)
    welcomed = run.on(b"a", _register(WorkerKind.ROLLOUT, "rollout-1"))
    assert welcomed.sent(UpdateWeights)[0].version == 1  # the chunks follow the Welcome
    assert not run.on(b"a", Ready(version=0)).sent(UpdateWeights)  # on their way already
    run.on(b"b", _register(WorkerKind.ROLLOUT, "rollout-2"))
    publish(2)  # while rollout-2 sets up
    ready = run.on(b"b", Ready(version=0))
    assert [type(m).__name__ for m in ready.sent()] == ["UpdateWeights", "WeightsChunk"]
    assert ready.sent(UpdateWeights)[0].version == 2


def test_stream_mode_sends_a_version_whole_to_a_worker_that_joins_while_it_arrives(tmp_path):
    """A worker welcomed, or ready, between a version's Trained and its last chunk is sent
    the whole version once the last chunk is in, never the chunks so far as if they were
    all of it (its load would fail the completeness check and be retried)."""
    run = _decisions(tmp_path, "stream")
    trainer = run.join(WorkerKind.TRAINER)
    ready = run.join(WorkerKind.ROLLOUT)
    chunks = [
        WeightsChunk(
            version=1,
            index=i,
            num_chunks=2,
            names=[f"w{i}"],
            tensors=[Tensor(np.zeros(2, np.float32))],
        )
        for i in range(2)
    ]
    _publish(run, 1, num_chunks=2)
    run.on(trainer.identity, chunks[0])
    joining = run.on(b"late", _register(WorkerKind.ROLLOUT, "rollout-1"))
    assert [type(m).__name__ for m in joining.sent()] == ["Welcome"]  # nothing partial
    assert not run.on(b"late", Ready(version=0)).sent(UpdateWeights)  # owed already
    last = run.on(trainer.identity, chunks[1])
    to_ready = [m for identity, m in last.messages if identity == ready.identity]
    to_late = [m for identity, m in last.messages if identity == b"late"]
    assert to_ready == [chunks[1]]  # announced at the publish: the relayed chunk
    assert [type(m).__name__ for m in to_late] == ["UpdateWeights", "WeightsChunk", "WeightsChunk"]
    assert to_late[0].num_chunks == 2 and to_late[1:] == chunks


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
