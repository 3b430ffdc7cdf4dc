"""How a weight set gets from the rollout worker's process into vLLM's worker processes.

vLLM runs the model in other processes (EngineCore, and one worker per GPU with tensor
parallelism); the rollout worker talks to them through `AsyncLLM.collective_rpc`, whose
arguments are msgpack-encoded and relayed by the EngineCore (and, with several workers,
broadcast through a shared-memory queue). Weights therefore never travel as RPC arguments:

- `DiskWeights(path)`: only the directory name is sent; each vLLM worker reads the
  safetensors files itself (memory-mapped).
- `TensorWeights(tensors)` (stream mode: the tensors arrived over ZeroMQ into this process):
  they are written once into one flat file in /dev/shm (RAM), laid out as the
  `TensorSpec`s of `areal.models.weights` (16-byte aligned), and only the file name and
  the specs are sent. Each vLLM worker maps the file read-only and `load_weights` copies
  from the mapping straight into its parameters (on GPU: host -> device). One copy in this
  process, one into the model, nothing through sockets; every tensor-parallel rank maps the
  same pages. The file is removed when the update returns (or fails).

Before anything is sent, names and shapes are checked against the checkpoint the engine
was started from (`CheckpointLayout`), so a bad update leaves the served weights as they
were. This module imports no vLLM.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping

import torch
from safetensors import safe_open

from areal.models.weights import (
    TensorSpec,
    WeightMismatchError,
    bucket_layout,
    unflatten_bucket,
)

__all__ = ["CheckpointLayout", "SharedWeights", "read_shared", "write_shared"]

_SHM_DIR = Path("/dev/shm")
_INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class CheckpointLayout:
    """The tensor names and shapes of a full checkpoint, under Hugging Face names."""

    shapes: Mapping[str, tuple[int, ...]]
    optional: frozenset[str] = frozenset()
    """Names that may be given or left out (a tied `lm_head.weight`)."""

    @classmethod
    def of_directory(cls, path: str | Path, *, tied_lm_head: bool) -> CheckpointLayout:
        """Read from the safetensors headers of `path` (no tensor data is read)."""
        return cls(
            safetensors_shapes(path), frozenset({"lm_head.weight"}) if tied_lm_head else frozenset()
        )

    def check(self, shapes: Mapping[str, tuple[int, ...]], what: str) -> None:
        """Raise WeightMismatchError on the first unknown, missing or reshaped tensor."""
        for name, shape in shapes.items():
            expected = self.shapes.get(name)
            if expected is None:
                if name in self.optional:
                    continue
                raise WeightMismatchError(
                    f"{what}: tensor {name!r} is not in the served model's checkpoint "
                    f"({len(self.shapes)} tensors, e.g. {next(iter(self.shapes), None)!r})"
                )
            if tuple(shape) != tuple(expected):
                raise WeightMismatchError(
                    f"{what}: tensor {name!r} has shape {tuple(shape)}, "
                    f"the served model's has {tuple(expected)}"
                )
        missing = [name for name in self.shapes if name not in shapes]
        if missing:
            raise WeightMismatchError(
                f"{what}: no tensor for {missing[0]!r} ({len(missing)} "
                "missing); updates must carry the full weight set"
            )


def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a safetensors directory, from the headers only."""
    directory = Path(path)
    index = directory / _INDEX_FILE
    if index.is_file():
        files = [
            directory / name
            for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))
        ]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"weights directory {str(directory)!r} has no *.safetensors file")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


@dataclass(frozen=True)
class SharedWeights:
    """A weight set in one shared-memory file; `rpc_args()` is what crosses to vLLM."""

    path: str
    specs: list[TensorSpec]
    num_bytes: int

    def rpc_args(self) -> dict:
        """Plain msgpack-friendly values (collective_rpc encodes its arguments)."""
        return {
            "path": self.path,
            "num_bytes": self.num_bytes,
            "specs": [[s.name, s.dtype, list(s.shape), s.offset, s.num_bytes] for s in self.specs],
        }

    def remove(self) -> None:
        Path(self.path).unlink(missing_ok=True)


def write_shared(tensors: Mapping[str, torch.Tensor]) -> SharedWeights:
    """Copy `tensors` into a new shared-memory file (one copy per tensor)."""
    specs, offset = bucket_layout(tensors.items())
    directory = _SHM_DIR if os.access(_SHM_DIR, os.W_OK) else Path(tempfile.gettempdir())
    fd, path = tempfile.mkstemp(dir=directory, prefix="areal-weights-", suffix=".bin")
    shared = SharedWeights(path=path, specs=specs, num_bytes=max(offset, 1))
    try:
        os.ftruncate(fd, shared.num_bytes)
        os.close(fd)
        buffer = torch.from_file(path, shared=True, size=shared.num_bytes, dtype=torch.uint8)
        for spec, tensor in zip(specs, tensors.values(), strict=True):
            raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            buffer[spec.offset : spec.offset + spec.num_bytes].copy_(raw)
    except BaseException:
        shared.remove()
        raise
    return shared


def read_shared(rpc_args: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into the mapped file described by `SharedWeights.rpc_args()`.

    The mapping is private and read-only in intent: nothing written to the views reaches the
    file. It lives as long as the returned tensors do.
    """
    buffer = torch.from_file(
        rpc_args["path"], shared=False, size=rpc_args["num_bytes"], dtype=torch.uint8
    )
    specs = [
        TensorSpec(name=name, dtype=dtype, shape=tuple(shape), offset=offset, num_bytes=num_bytes)
        for name, dtype, shape, offset, num_bytes in rpc_args["specs"]
    ]
    return unflatten_bucket(buffer, specs)
