"""Weight-publishing primitives shared by the trainer and the rollout engines.

Contract:
- `named_tensors` lists a model's parameters under their Hugging Face checkpoint names, each
  tensor once: a tied `lm_head.weight` is left out, as `save_pretrained` leaves it out, and
  is restored by tying, not by copying. Models whose in-memory layout differs from their
  checkpoint (transformers 5 converts e.g. per-expert MoE weights into fused tensors at
  load) are refused rather than published under names no engine would recognise.
- `save_tensors` writes one safetensors file by temp-file + fsync + rename in the same
  directory, so a reader sees either the previous complete file or the new complete file.
- `copy_into_model` updates a live model in place (`param.data.copy_`): parameter objects
  keep their identity, so optimisers and engines holding references stay valid. Every name
  and shape is checked before the first byte is copied, so a bad update leaves the model as
  it was.
- `bucket_tensors` / `flatten_bucket` / `unflatten_bucket` / `merge_buckets` cut a weight
  set into buckets of bounded bytes for streaming or broadcast, and put it back together.

Not here: transport (ZeroMQ frames, collectives), version directories and their cleanup,
optimiser state.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable, Iterator, Mapping

import torch
from safetensors.torch import load_file, save_file
from torch import nn

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
"""A dict of tensors or an iterable of (name, tensor) pairs."""

WEIGHTS_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_ALIGN = 16
"""Byte alignment of tensors inside a flat bucket, so every dtype can be viewed in place."""


class WeightMismatchError(ValueError):
    """Incoming tensors do not match the model's parameters (name, shape or tied copies)."""


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """Where one tensor lies inside a flat uint8 bucket; plain fields, msgpack-friendly."""

    name: str
    dtype: str  # torch dtype name without the 'torch.' prefix, e.g. 'bfloat16'
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the bucket, a multiple of 16
    num_bytes: int


def named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, detached parameter) for every distinct parameter, in module order.

    The tensors share storage with the model: copy them before the model changes if they
    must outlive this step.
    """
    _check_checkpoint_layout(model)
    for name, param in model.named_parameters():  # deduplicates tied parameters
        yield name, param.detach()


def save_tensors(
    directory: str | Path,
    tensors: NamedTensors,
    *,
    filename: str = WEIGHTS_FILE,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write tensors to directory/filename atomically; returns the file's path.

    Tensors are moved to CPU and made contiguous; tensors sharing storage (tied weights
    passed under two names) are cloned, which safetensors requires. `metadata` is stored
    in the header next to {'format': 'pt'} (what transformers expects).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    prepared = _prepare_for_save(tensors)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{filename}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(prepared, tmp, metadata={"format": "pt", **(metadata or {})})
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; readers may be other users
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        target = directory / filename
        os.replace(tmp, target)
        _fsync_directory(directory)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def load_tensors(
    directory: str | Path, *, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors directory: the files named by its index, else every
    *.safetensors file (temporary files of an unfinished `save_tensors` are never read)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"weights directory {str(directory)!r} does not exist")
    index = directory / _INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / name for name in names]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"weights directory {str(directory)!r} has no *.safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        for name, tensor in load_file(path, device=str(device)).items():
            if name in tensors:
                raise WeightMismatchError(
                    f"tensor {name!r} appears in more than one file of "
                    f"{str(directory)!r} (again in {path.name})"
                )
            tensors[name] = tensor
    return tensors


def copy_into_model(model: nn.Module, tensors: NamedTensors, *, strict: bool = True) -> None:
    """Copy tensors into the model's parameters in place (dtype and device are converted).

    Names are checkpoint names; a tied parameter may be given under any of its names.
    strict=True also requires every parameter to be given (a full update); strict=False
    accepts a subset (one bucket of a streamed update). Raises WeightMismatchError naming
    the first unknown name, wrong shape, missing parameter or disagreeing tied copy, before
    anything is copied.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    given: dict[int, tuple[str, torch.Tensor]] = {}
    names: set[str] = set()
    for name, tensor in items:
        if name in names:
            raise WeightMismatchError(f"tensor {name!r} is given twice")
        names.add(name)
        param = params.get(name)
        if param is None:
            raise WeightMismatchError(
                f"tensor {name!r} is not a parameter of {type(model).__name__} "
                f"(it has {len(params)} parameter names, e.g. {next(iter(params), None)!r})"
            )
        if tuple(tensor.shape) != tuple(param.shape):
            raise WeightMismatchError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the "
                f"model's parameter has {tuple(param.shape)}"
            )
        earlier = given.setdefault(id(param), (name, tensor))
        if earlier[0] != name and not torch.equal(earlier[1].cpu(), tensor.cpu()):
            raise WeightMismatchError(
                f"tensors {earlier[0]!r} and {name!r} are tied in the model but differ"
            )
    if strict:
        for name, param in model.named_parameters():
            if id(param) not in given:
                missing = sum(id(p) not in given for p in model.parameters())
                raise WeightMismatchError(
                    f"no tensor for parameter {name!r} ({missing} parameters missing); pass "
                    "strict=False for a partial update"
                )
    with torch.no_grad():
        for name, tensor in given.values():
            params[name].data.copy_(tensor)


def bucket_tensors(
    tensors: NamedTensors, max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of (name, tensor), each at most max_bytes in total, order kept.

    A single tensor larger than max_bytes forms a bucket of its own; no tensor is split.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes} must be >= 1")
    bucket: list[tuple[str, torch.Tensor]] = []
    bucket_bytes = 0
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    for name, tensor in items:
        size = tensor.numel() * tensor.element_size()
        if bucket and bucket_bytes + size > max_bytes:
            yield bucket
            bucket, bucket_bytes = [], 0
        bucket.append((name, tensor))
        bucket_bytes += size
    if bucket:
        yield bucket


def bucket_layout(tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[TensorSpec], int]:
    """Where each of `tensors` lies in a flat bucket (in order, each at an offset aligned to
    16 bytes, so every dtype can be viewed in place), and the bucket's size in bytes. The
    layout of a broadcast bucket, a weight slot's payload and a shared-memory weight file."""
    specs, offset = [], 0
    for name, tensor in tensors:
        num_bytes = tensor.numel() * tensor.element_size()
        specs.append(
            TensorSpec(
                name=name,
                dtype=str(tensor.dtype).removeprefix("torch."),
                shape=tuple(tensor.shape),
                offset=offset,
                num_bytes=num_bytes,
            )
        )
        offset += -(-num_bytes // _ALIGN) * _ALIGN
    return specs, offset


def flatten_bucket(
    bucket: Iterable[tuple[str, torch.Tensor]],
) -> tuple[torch.Tensor, list[TensorSpec]]:
    """One contiguous uint8 buffer holding every tensor's bytes, plus where each lies.

    The buffer is on the device of the first tensor (a broadcast sends it as one message).
    Offsets are aligned to 16 bytes, so the buffer can be a little larger than the sum.
    """
    pairs = list(bucket)
    specs, offset = bucket_layout(pairs)
    device = pairs[0][1].device if pairs else torch.device("cpu")
    buffer = torch.empty(offset, dtype=torch.uint8, device=device)
    for spec, (_, tensor) in zip(specs, pairs, strict=True):
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[spec.offset : spec.offset + spec.num_bytes].copy_(raw)
    return buffer, specs


def unflatten_bucket(
    buffer: torch.Tensor, specs: Iterable[TensorSpec]
) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a flat bucket; tensors are views into `buffer`."""
    out = []
    for spec in specs:
        dtype = getattr(torch, spec.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor {spec.name!r}: unknown dtype {spec.dtype!r}")
        end = spec.offset + spec.num_bytes
        if end > buffer.numel():
            raise ValueError(
                f"tensor {spec.name!r} ends at byte {end}, past the bucket's {buffer.numel()} bytes"
            )
        out.append((spec.name, buffer[spec.offset : end].view(dtype).view(spec.shape)))
    return out


def merge_buckets(buckets: Iterable[Iterable[tuple[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Reassemble buckets into one name -> tensor dict, refusing a name seen twice."""
    merged: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        for name, tensor in bucket:
            if name in merged:
                raise WeightMismatchError(f"tensor {name!r} appears in two buckets")
            merged[name] = tensor
    return merged


def _check_checkpoint_layout(model: nn.Module) -> None:
    """Refuse models whose parameter names are not their checkpoint names.

    transformers 5 may convert checkpoint tensors at load (e.g. per-expert MoE weights fused
    into one tensor) and reverts that in save_pretrained. Running the revert on meta
    tensors tells, without copying data, whether names would change.
    """
    if not hasattr(model, "config"):
        return  # a plain nn.Module: its names are its own
    from transformers.core_model_loading import revert_weight_conversion

    meta = {
        name: torch.empty(p.shape, dtype=p.dtype, device="meta")
        for name, p in model.named_parameters()
    }
    reverted = revert_weight_conversion(model, dict(meta))
    changed = sorted(set(meta) - set(reverted))
    if changed:
        raise NotImplementedError(
            f"{type(model).__name__} keeps {changed[0]!r} (and {len(changed) - 1} more) in a "
            "layout transformers converts at load; publishing such weights under checkpoint "
            "names is not supported"
        )


def _prepare_for_save(tensors: NamedTensors) -> dict[str, torch.Tensor]:
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    prepared: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in items:
        if name in prepared:
            raise WeightMismatchError(f"tensor {name!r} is given twice")
        tensor = tensor.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage()
        # safetensors refuses tensors that share or only partly cover their storage.
        if storage.data_ptr() in storages or storage.nbytes() != tensor.nbytes:
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        prepared[name] = tensor
    return prepared


def _fsync_directory(directory: Path) -> None:
    """Persist the rename itself (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
