"""The weights group: every member receives exactly the sender's tensors, across re-forming.

Four real processes meet at the sender's TCPStore (the trainer's rendezvous code):
generation 1 is sender + members A and B; B then exits (a crashed rollout worker) and C
joins late, so generation 2 is sender + A + C. Each receiver's tensors must be bitwise equal
to what was sent (bf16, fp32 and int64 tensors, several buckets, a tensor larger than a
bucket). Operations of a generation that a newer one replaced are skipped, not run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from areal.workers.collective import (
    Superseded,
    WeightsGroup,
    connect_store,
    host_store,
    snapshot_weights,
)

BUCKET_BYTES = 4096


def _weights(version: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(version)
    return [
        ("embed.weight", torch.randn(40, 16, generator=gen).bfloat16()),
        ("layer.weight", torch.randn(33, 17, generator=gen)),  # 2244 B: not 16-aligned
        ("layer.bias", torch.randn(17, generator=gen)),
        ("big.weight", torch.randn(2000, generator=gen)),  # 8000 B > one bucket
        ("counter", torch.tensor([version, 7], dtype=torch.int64)),
    ]


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Received tensors are views of one bucket buffer: clone them to save them apart."""
    torch.save({name: t.clone() for name, t in tensors.items()}, path)


def _process(index: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    role = ["sender", "A", "B", "C"][index]
    group = WeightsGroup()
    if role == "sender":
        store, _ = host_store("127.0.0.1", port, timeout_s=60)
    else:
        store = connect_store(f"127.0.0.1:{port}", timeout_s=60)
    common = dict(store=store, backend="gloo", timeout_s=60)
    if role in ("sender", "A", "B"):  # generation 1: sender, A, B
        group.join(generation=1, rank=["sender", "A", "B"].index(role), world_size=3, **common)
        snapshot = snapshot_weights(_weights(1), 1, BUCKET_BYTES)
        if role == "sender":
            assert len(snapshot.buffers) >= 3
            group.send(snapshot, 1)
        else:
            _save(group.receive(snapshot.manifest, 1), Path(out, f"{role}-v1.pt"))
    if role == "B":
        return  # gone: generation 2 is formed without it
    group.announce(2)
    group.join(generation=2, rank=["sender", "A", "C"].index(role), world_size=3, **common)
    snapshot = snapshot_weights(_weights(2), 2, BUCKET_BYTES)
    if role == "sender":
        group.send(snapshot, 2)
    else:
        _save(group.receive(snapshot.manifest, 2), Path(out, f"{role}-v2.pt"))


@pytest.mark.slow
def test_every_member_receives_identical_tensors_across_generations(tmp_path, free_port):
    mp.start_processes(_process, args=(free_port, str(tmp_path)), nprocs=4, start_method="spawn")
    for version, members in ((1, "AB"), (2, "AC")):
        sent = dict(_weights(version))
        for member in members:
            got = torch.load(tmp_path / f"{member}-v{version}.pt")
            assert list(got) == list(sent), f"{member} v{version}: names or order differ"
            for name, tensor in sent.items():
                assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
                assert torch.equal(got[name], tensor), f"{member} v{version}: {name} differs"


def test_operations_of_a_replaced_generation_are_skipped():
    group = WeightsGroup()
    group.announce(3)
    snapshot = snapshot_weights(_weights(1), 1, BUCKET_BYTES)
    with pytest.raises(Superseded, match="generation 3 replaces it"):
        group.send(snapshot, 2)
    with pytest.raises(Superseded):
        group.receive(snapshot.manifest, 2)
    with pytest.raises(Superseded):
        group.join(
            store="127.0.0.1:1", generation=2, rank=1, world_size=2, backend="gloo", timeout_s=1
        )
