"""The trainer's data-parallel group: what the PPO step needs from torch.distributed.

    ranks 0..R-1 --init_process_group(store of rank 0, gloo | nccl)--> the default group
    per minibatch:  local micro-batches -> backward (loss / GLOBAL minibatch loss tokens)
                    'allreduce': grads summed over ranks after accumulation (buckets, SUM)
                    'fsdp':      fully_shard (FSDP2) reduce-scatters every backward and
                                 divides by R; the loss is scaled by R (`loss_scale`), so
                                 shards hold the SUM over ranks
                    -> identical clip and optimiser step on every rank
    per step:       stats summed / maxed over ranks (one all-reduce each)
    publishing:     full weights on rank 0 ('fsdp': gathered, a collective of all ranks);
                    with LoRA the adapters alone (FSDP gathers only the trainable state)

Why SUM and not DDP's average: every rank divides its loss by the global loss-token count
of the minibatch (areal.algorithms.sharding), so the sum over ranks of the gradients is
exactly the gradient of the token-level mean over the global minibatch. The gradients
after reduction are the same on every rank (bitwise: one all-reduce result), so clipping
and AdamW, which are deterministic, keep the replicas identical ('allreduce'), or update
the shards of one logical model ('fsdp').

FSDP runs collectives inside forward and backward, so under 'fsdp' every rank must run
the same number of forward passes: ranks agree on the largest micro-batch count and pad
with zero-weight passes over a one-token dummy (`sync_num_passes`). 'allreduce' needs no
such agreement: ranks meet only at the gradient reduction.

`DataParallel.single()` is the one-process case: every method is a no-op. Not here: the
rendezvous address (workers/collective.py), sockets, weight publishing.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterator
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from areal.models.lora import adapter_tensors, has_adapters, select_adapters
from areal.models.weights import named_tensors

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)

log = logging.getLogger(__name__)

MODES = ("allreduce", "fsdp")


def resolve_mode(mode: str, device: str) -> str:
    """'auto' -> FSDP2 on GPUs, an explicit gradient all-reduce (DDP-equivalent) on CPU."""
    if mode == "auto":
        return "fsdp" if device.startswith("cuda") else "allreduce"
    if mode not in MODES:
        raise ValueError(f"trainer.data_parallel={mode!r} is not one of auto, {', '.join(MODES)}")
    return mode


class DataParallel:
    """Collectives of one trainer rank; world_size 1 (`single()`) makes them no-ops."""

    def __init__(self, rank: int, world_size: int, mode: str, bucket_bytes: int = 64 << 20) -> None:
        self.rank = rank
        self.world_size = world_size
        self.mode = mode
        self.bucket_bytes = bucket_bytes

    @classmethod
    def single(cls) -> DataParallel:
        return cls(0, 1, "allreduce")

    @classmethod
    def join(
        cls,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        backend: str,
        mode: str,
        timeout_s: float,
        generation: int = 1,
        bucket_bytes: int = 64 << 20,
    ) -> DataParallel:
        """Join the default process group through `store` (blocks until all ranks are in)."""
        device_id = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"trainer/{generation}", store),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device_id,
        )
        log.info(
            "trainer rank %d/%d joined the data-parallel group (%s, %s)",
            rank,
            world_size,
            backend,
            mode,
        )
        return cls(rank, world_size, mode, bucket_bytes)

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def fsdp(self) -> bool:
        return self.active and self.mode == "fsdp"

    # -- model ----------------------------------------------------------------------------------

    def wrap(self, model: ModuleT) -> ModuleT:
        """Shard `model` with FSDP2 ('fsdp'): each decoder layer, then the root. In place
        (fully_shard keeps the module's class, mixing FSDP's in)."""
        if not self.fsdp:
            return model
        from torch.distributed.fsdp import fully_shard

        layer_types = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in layer_types:
                fully_shard(module)
        fully_shard(model)
        # FSDP averages over ranks; `loss_scale` undoes that. (set_gradient_divide_factor(1)
        # would too, but needs PREMUL_SUM, which gloo lacks.)
        return model

    @property
    def loss_scale(self) -> float:
        """Factor on each backward's loss so that the reduced gradient is the SUM over ranks."""
        return float(self.world_size) if self.fsdp else 1.0

    def full_weights(self, model: torch.nn.Module) -> list[tuple[str, torch.Tensor]] | None:
        """What rank 0 publishes, None on the others: (name, tensor) of every parameter
        under checkpoint names, or for a model with LoRA adapters only the adapters, under
        PEFT's names (areal.models.lora). Without FSDP these are views of the live
        parameters (publish them before the next step); under 'fsdp' they are gathered CPU
        copies, and every rank must call this (it is a collective)."""
        adapters = has_adapters(model)
        if not self.fsdp:
            if self.rank != 0:
                return None
            return adapter_tensors(model) if adapters else list(named_tensors(model))
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        names = [] if adapters else [name for name, _ in named_tensors(model)]  # tied once
        full = get_model_state_dict(
            model,
            options=StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapters
            ),
        )
        if self.rank != 0:
            return None
        tensors = cast("dict[str, torch.Tensor]", full)  # a full state dict: tensors only
        if adapters:
            return select_adapters(tensors.items())
        return [(name, tensors[name]) for name in names]

    # -- collectives ----------------------------------------------------------------------------

    def sync_num_passes(self, num_passes: int) -> int:
        """The largest pass count over ranks under 'fsdp' (each rank pads up to it)."""
        if not self.fsdp:
            return num_passes
        count = torch.tensor([num_passes], dtype=torch.long, device=self._device())
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return int(count.item())

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """'allreduce': sum every gradient over ranks, in flat buckets (a rank that had no
        data contributes zeros). 'fsdp' reduced them in backward already."""
        if not self.active or self.fsdp:
            return
        # A parameter with a gradient on no rank keeps grad None, as on a single rank
        # (AdamW skips it); one with a gradient somewhere gets zeros where it has none.
        has_grad = torch.tensor(
            [p.grad is not None for p in params], dtype=torch.int32, device=self._device()
        )
        dist.all_reduce(has_grad, op=dist.ReduceOp.MAX)
        params = [p for p, has in zip(params, has_grad.tolist(), strict=True) if has]
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = cast("list[torch.Tensor]", [p.grad for p in params])  # each set just above
        for bucket in _buckets(grads, self.bucket_bytes):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for grad in bucket:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def sum_and_max(
        self, sums: torch.Tensor, maxes: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[K] float64 sums and [M] float64 maxima, reduced over ranks (copies)."""
        sums, maxes = sums.clone(), maxes.clone()
        if self.active:
            device = self._device()
            sums_d, maxes_d = sums.to(device), maxes.to(device)
            dist.all_reduce(sums_d, op=dist.ReduceOp.SUM)
            dist.all_reduce(maxes_d, op=dist.ReduceOp.MAX)
            sums, maxes = sums_d.cpu(), maxes_d.cpu()
        return sums, maxes

    def close(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()

    def _device(self) -> torch.device:
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _buckets(tensors: list[torch.Tensor], max_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive tensors of one dtype and device, at most max_bytes per bucket."""
    bucket: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and (
            size + nbytes > max_bytes
            or tensor.dtype != bucket[0].dtype
            or tensor.device != bucket[0].device
        ):
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += nbytes
    if bucket:
        yield bucket
