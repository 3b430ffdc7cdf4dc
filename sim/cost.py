"""The cost model of the cluster simulation: how long each piece of work takes, in one place.

Every duration a simulated worker spends comes from here, from three kinds of numbers read
from `costs.yaml` (each with its source there):

- an accelerator: peak dense bf16 FLOP/s, HBM size and bandwidth, links within and across
  nodes, devices per node;
- a model shape (the published config.json of Qwen2.5 / R1-Distill-Qwen): layers, widths,
  heads, vocabulary; from it parameters, bytes of weights and of KV cache per token, FLOPs;
- a few efficiency factors shared by every model size, mode and scale: the fraction of peak
  FLOP/s dense work reaches (`mfu`), of HBM bandwidth decoding reaches (`hbm`), of link
  bandwidth collectives reach (`link`), and fixed per-step costs.

Formulas (P_m = parameters in matrix products, L layers, h hidden width, bf16 = 2 bytes):
    decode step, batch b, KV context C tokens, TP t:
        t_step = o_step + o_layer*L + o_seq*b + max(F/(t*peak*mfu), M/(hbm_bw*hbm))
                 + TP all-reduces (2 per layer of b*h*2 bytes, ring over intra-node links)
        F = 2*P_m*b + 4*L*h*C          (matmuls + attention of b new tokens over C)
        F = 2*P_m*b + 4*L*h*b*C        with `decode_pack_attention` (a measured entry whose
                                       fit says so: every new token attends over the whole
                                       batch's cache under a mask, as the CPU engine does)
        M = (weight bytes + kv_bytes_per_token*C) / t
    prefill of sequences of n_i tokens: max(F/(t*peak*mfu), weights/t/(hbm_bw*hbm)),
        F = 2*P_m*sum(n_i) + 2*L*h*sum(n_i^2)      (causal attention, forward)
    training on one data-parallel rank: (3 + r) * F(shard) / (peak*train_mfu) + o_train
        with r = 1 when the proximal log-probs are recomputed (a forward pass), 0 with
        `loglinear`; plus per PPO minibatch a ring all-reduce of the bf16 gradients.
        train_mfu defaults to mfu and o_train (a fixed cost per step) to 0: the GPU entries
        use neither; a measured entry (the CPU machine, areal.sim.calibrate) sets both,
        because its trainer pays per-step costs (optimiser, Python) that FLOPs do not show.
        With `train_pack_attention` (a measured entry whose fit says so) attention spans each
        whole packed micro-batch of N_mb tokens (a dense block-diagonal mask, as sdpa runs
        the trainer's packs on CPU): its forward FLOPs are 4*L*h*N_mb^2 in place of
        2*L*h*sum(n_i^2), with micro-batches of trainer.micro_batch_tokens
    weights: moving them costs bytes / (link bandwidth * link efficiency); a rollout server
        taking a new version also pays `weight_update_overhead_s` (0 on GPUs; the CPU
        engine restarts its session, measured)
    LoRA of rank r (`lora_rank`, trainer.lora; the `lora` entry of costs.yaml): a version
        is the adapters alone, P_a = r * sum(in + out) over the adapted projections of every
        layer (bf16), so publishing, loading and the gradient all-reduce move P_a * 2 bytes;
        training skips the frozen base's weight gradients, the `backward_weight_grad_share`
        of the backward pass: passes = 1 + 2 * (1 - share) + r_prox (+ the adapters' own
        6 * P_a FLOPs per token); decoding and prefill apply the adapters unmerged
        (+ 2 * P_a FLOPs per token; the adapter kernels' own overhead is not modelled)
    colocated synchronous switches (`switch_costs`, costs.yaml `colocation`): per step each
        device moves its engine's weight shard W/t out to host memory (KV cache dropped) and
        back in (KV cache allocated again), and the trainer's sharded states (14 bytes a
        parameter: bf16 weights, fp32 master weights, AdamW moments, over the N ranks) in and
        out: (W/t + 14*P/N) * (1/(host*sleep) + 1/(host*wake)) + wake_overhead_s

Not modelled (said so where it matters): kernel-level effects beyond the roofline, the
optimiser step, checkpoints, pipeline bubbles, stragglers, network contention between jobs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import numpy as np
import yaml

COSTS_FILE = Path(__file__).with_name("costs.yaml")
BF16_BYTES = 2


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    name: str
    peak_flops: float
    """Dense bf16 FLOP/s."""
    hbm_bytes: float
    hbm_bandwidth: float
    """Bytes/s."""
    intra_node_bandwidth: float
    """Bytes/s per device, one direction, to the devices of its node."""
    inter_node_bandwidth: float
    """Bytes/s per device, one direction, to other nodes."""
    devices_per_node: int
    host_bandwidth: float | None = None
    """Bytes/s per device, one direction, between the device and host memory (PCIe); only
    the colocated switches use it (None: not priced for this accelerator)."""
    shared_cores: int | None = None
    """The CPU machine, where one accelerator is one thread of a worker: the threads of every
    worker of a run share this many cores (sim/workers.py, Host). None: each worker has its
    accelerators to itself."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        """Attention (q/k/v with bias, o), SwiGLU MLP, two norms of one decoder layer."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * self.intermediate + 2 * h

    @property
    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * self.layer_params + embeddings + self.hidden

    @property
    def matmul_params(self) -> int:
        """Parameters used in matrix products per token (the input embedding is a lookup;
        the output projection is a product even when it shares the embedding's weights)."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        return self.params * BF16_BYTES

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * BF16_BYTES

    def adapter_params(self, rank: int, targets: Sequence[str]) -> int:
        """LoRA parameters at `rank` on the named projections of every layer (A: r x in,
        B: out x r per projection)."""
        h, kv, inter = self.hidden, self.kv_heads * self.head_dim, self.intermediate
        shapes = {
            "q_proj": (h, h),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (h, h),
            "gate_proj": (h, inter),
            "up_proj": (h, inter),
            "down_proj": (inter, h),
        }
        unknown = [t for t in targets if t not in shapes]
        if unknown:
            raise ValueError(
                f"lora target {unknown[0]!r} is not a projection of the cost "
                f"model's layer ({', '.join(shapes)})"
            )
        return self.layers * sum(rank * sum(shapes[t]) for t in targets)

    def forward_flops(self, num_tokens: float, sum_sq_lengths: float) -> float:
        """FLOPs of a causal forward pass over sequences holding `num_tokens` in all, the
        sum of whose squared lengths is `sum_sq_lengths`."""
        return 2 * self.matmul_params * num_tokens + 2 * self.layers * self.hidden * sum_sq_lengths


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    mfu: float
    """Fraction of peak FLOP/s reached by dense forward/backward work."""
    hbm: float
    """Fraction of HBM bandwidth reached by decoding."""
    link: float
    """Fraction of link bandwidth reached by collectives and weight transfers."""
    step_overhead_s: float
    """Fixed cost of one decode step."""
    layer_step_overhead_s: float
    """Fixed cost of one decode step per layer (kernels that cannot be shorter)."""
    seq_step_overhead_s: float
    """Cost of one decode step per running sequence beyond the roofline (sampling,
    bookkeeping): what the CPU engine pays, negligible on GPU engines."""
    train_mfu: float | None = None
    """Fraction of peak FLOP/s reached by the trainer's forward/backward; None: `mfu`."""
    train_step_overhead_s: float = 0.0
    """Fixed cost of one training step on one rank beyond its FLOPs (optimiser step,
    Python, packing): 0 on GPUs (hidden by the FLOPs), measured on the CPU machine."""
    train_pack_attention: bool = False
    """The trainer's attention costs the square of each packed micro-batch's tokens (a
    dense mask over the pack) rather than of each sequence's: False on GPUs (varlen
    kernels), decided by the fit on the CPU machine."""
    decode_pack_attention: bool = False
    """A decode step's attention costs (batch x context) rather than context: each new
    token is scored against every running sequence's cache under a mask. False on GPUs
    (paged-attention kernels), decided by the fit on the CPU machine."""
    weight_update_overhead_s: float = 0.0
    """Fixed cost of a rollout server's weight update beyond moving the bytes (pause,
    engine restart): 0 for the GPU entries (not modelled), measured on the CPU machine."""
    train_contention: float | None = None
    """Slowdown of training while generation runs on the same cores; None: `contention`
    (which then is generation's slowdown while training runs)."""
    contention: float = 1.0
    """Slowdown of generation and of training while the other runs on the same devices
    (the CPU machine, where every process shares the cores); 1 on separate accelerators."""


@dataclass(frozen=True, kw_only=True)
class Lora:
    """LoRA training (the cost file's `lora` entry, with the run's rank)."""

    rank: int
    target_modules: tuple[str, ...]
    backward_weight_grad_share: float
    """Fraction of the backward pass that computes weight gradients (skipped for the frozen
    base)."""


@dataclass(frozen=True, kw_only=True)
class Colocation:
    """What a colocated synchronous system pays to switch its accelerators between
    generation and training (costs.yaml `colocation`, each number with its source)."""

    sleep_efficiency: float
    """Fraction of `host_bandwidth` reached moving weights out to host memory (an engine's
    sleep, a trainer's offload), every device of a node at once."""
    wake_efficiency: float
    """The same into the device (an engine's wake, a trainer's reload)."""
    wake_overhead_s: float
    """Fixed cost of an engine's wake beyond moving its weights (KV cache allocated again)."""
    offload_trainer: bool
    """The trainer's states leave the device while the engine generates."""


TRAINER_STATE_BYTES = 14
"""Bytes a parameter of the trainer's states: bf16 weights, fp32 master weights, AdamW's two
fp32 moments (gradients exist only inside a step)."""


class CostModel:
    """Durations of generation, training and weight movement for one cluster and model."""

    def __init__(
        self,
        accelerator: Accelerator,
        model: ModelShape,
        efficiency: Efficiency,
        mem_fraction: float,
        lora: Lora | None = None,
        colocation: Colocation | None = None,
    ) -> None:
        self.acc = accelerator
        self.model = model
        self.eff = efficiency
        self.mem_fraction = mem_fraction
        """Fraction of device memory an inference engine takes (weights + KV cache)."""
        self.colocation = colocation
        self.lora = lora
        self.adapter_params = model.adapter_params(lora.rank, lora.target_modules) if lora else 0
        """LoRA parameters (0: full fine-tuning)."""

    @property
    def published_bytes(self) -> int:
        """Bytes of one published version: the weights, or with LoRA the adapters."""
        return self.adapter_params * BF16_BYTES if self.lora else self.model.weight_bytes

    # -- generation -----------------------------------------------------------------------------

    def kv_capacity_tokens(self, tp: int) -> int:
        """Tokens of KV cache a rollout server of `tp` devices holds beside its weights."""
        free = self.acc.hbm_bytes * self.mem_fraction * tp - self.model.weight_bytes
        if free <= 0:
            raise ValueError(
                f"{self.model.name} ({self.model.weight_bytes / 1e9:.1f} GB of weights) does "
                f"not fit on {tp} x {self.acc.name} at mem_fraction {self.mem_fraction}; "
                "raise the tensor-parallel size of the rollout servers (cluster.rollout_tp)"
            )
        return int(free // self.model.kv_bytes_per_token)

    def _decode_terms(self, batch: int, tp: int) -> tuple[float, float, float, float, float]:
        """(fixed s, compute s at C=0, compute s per context token, memory s at C=0, memory
        s per context token) of one decode step of `batch` sequences."""
        m, acc, eff = self.model, self.acc, self.eff
        flops_rate = tp * acc.peak_flops * eff.mfu
        bytes_rate = acc.hbm_bandwidth * eff.hbm
        fixed = (
            eff.step_overhead_s
            + eff.layer_step_overhead_s * m.layers
            + eff.seq_step_overhead_s * batch
        )
        if tp > 1:  # two all-reduces of the activations per layer, ring over NVLink
            size = batch * m.hidden * BF16_BYTES
            fixed += 2 * m.layers * 2 * (tp - 1) / tp * size / (acc.intra_node_bandwidth * eff.link)
        attended = batch if eff.decode_pack_attention else 1  # queries per context token
        return (
            fixed,
            2 * (m.matmul_params + self.adapter_params) * batch / flops_rate,
            4 * m.layers * m.hidden * attended / flops_rate,
            m.weight_bytes / tp / bytes_rate,
            m.kv_bytes_per_token / tp / bytes_rate,
        )

    def decode_s(self, batch: int, context: float, steps: int, tp: int) -> float:
        """Seconds of `steps` decode steps of `batch` sequences whose KV context totals
        `context` tokens at the first step and grows by `batch` tokens per step."""
        if steps <= 0 or batch <= 0:
            return 0.0
        fixed, c0, c1, m0, m1 = self._decode_terms(batch, tp)
        # step k: fixed + max(c0 + c1*(C + b*k), m0 + m1*(C + b*k)): a max of two lines in k
        compute = (c0 + c1 * context, c1 * batch)
        memory = (m0 + m1 * context, m1 * batch)
        return steps * fixed + _sum_max_of_lines(compute, memory, steps)

    def decode_steps_within(
        self, batch: int, context: float, seconds: float, tp: int, limit: int
    ) -> int:
        """Whole decode steps completed within `seconds` (at most `limit`)."""
        if seconds <= 0 or limit <= 0:
            return 0
        if self.decode_s(batch, context, limit, tp) <= seconds:
            return limit
        low, high = 0, limit  # decode_s(low) <= seconds < decode_s(high)
        while high - low > 1:
            mid = (low + high) // 2
            if self.decode_s(batch, context, mid, tp) <= seconds:
                low = mid
            else:
                high = mid
        return low

    def prefill_s(self, lengths: Sequence[int], tp: int) -> float:
        """Seconds to prefill sequences of these lengths (prompt + tokens so far) at once."""
        if len(lengths) == 0:
            return 0.0
        tokens, sum_sq = _moments(lengths)
        flops = self.model.forward_flops(tokens, sum_sq) + 2 * self.adapter_params * tokens
        compute = flops / (tp * self.acc.peak_flops * self.eff.mfu)
        memory = self.model.weight_bytes / tp / (self.acc.hbm_bandwidth * self.eff.hbm)
        return (
            max(compute, memory)
            + self.eff.step_overhead_s
            + self.eff.layer_step_overhead_s * self.model.layers
        )

    def weight_load_s(self, tp: int) -> float:
        """A rollout server receiving a new weight version (its shard) over the network."""
        return (
            self.published_bytes / tp / (self.acc.inter_node_bandwidth * self.eff.link)
            + self.eff.weight_update_overhead_s
        )

    # -- training -------------------------------------------------------------------------------

    def train_s(
        self,
        lengths: Sequence[int] | np.ndarray,
        num_minibatches: int,
        num_ranks: int,
        recompute_prox: bool,
        micro_batch_tokens: int = 8192,
    ) -> float:
        """Seconds one data-parallel rank (one device) spends on its shard of a step."""
        tokens, sum_sq = _moments(lengths)
        if self.eff.train_pack_attention and tokens > 0:
            # micro-batches of equal size within each minibatch; a full square each
            packs = num_minibatches * max(
                1, math.ceil(tokens / num_minibatches / micro_batch_tokens)
            )
            sum_sq = 2 * packs * (tokens / packs) ** 2
        backward = 2.0 if self.lora is None else 2 * (1 - self.lora.backward_weight_grad_share)
        passes = 1 + backward + (1 if recompute_prox else 0)  # + the proximal forward pass
        flops = (
            passes * self.model.forward_flops(tokens, sum_sq)
            + (3 + (1 if recompute_prox else 0)) * 2 * self.adapter_params * tokens
        )
        compute = flops / (self.acc.peak_flops * self.train_mfu)
        return (
            compute
            + self.eff.train_step_overhead_s
            + num_minibatches * self.allreduce_s(self.published_bytes, num_ranks)
        )

    @property
    def train_mfu(self) -> float:
        return self.eff.mfu if self.eff.train_mfu is None else self.eff.train_mfu

    def allreduce_s(self, num_bytes: float, num_ranks: int) -> float:
        """A ring all-reduce of `num_bytes` over `num_ranks` devices (inter-node links once
        the ranks span more than one node)."""
        if num_ranks <= 1:
            return 0.0
        bandwidth = (
            self.acc.intra_node_bandwidth
            if num_ranks <= self.acc.devices_per_node
            else self.acc.inter_node_bandwidth
        )
        return 2 * (num_ranks - 1) / num_ranks * num_bytes / (bandwidth * self.eff.link)

    def publish_s(self, colocated: bool) -> float:
        """Trainer rank 0 handing a new version to the rollout servers: over the network
        (separate devices), or resharded within each node (colocated, as verl does)."""
        bandwidth = self.acc.intra_node_bandwidth if colocated else self.acc.inter_node_bandwidth
        return self.published_bytes / (bandwidth * self.eff.link)

    def switch_s(self, num_devices: int, tp: int) -> float:
        """Seconds a colocated synchronous step spends switching each device (all in
        parallel) from generation to training and back: the engine's weight shard out to
        host memory and in again (its KV cache dropped, then allocated), the trainer's
        sharded states in and out (module docstring)."""
        c, host = self.colocation, self.acc.host_bandwidth
        if c is None or host is None:
            raise ValueError(
                f"the cost file prices no colocated switch for {self.acc.name}: "
                "it needs a `colocation` section and the accelerator's "
                "host_bandwidth (see sim/costs.yaml)"
            )
        moved = self.model.weight_bytes / tp
        if c.offload_trainer:
            moved += TRAINER_STATE_BYTES * self.model.params / num_devices
        return (
            moved / (host * c.sleep_efficiency)
            + moved / (host * c.wake_efficiency)
            + c.wake_overhead_s
        )


def _moments(lengths: Sequence[int] | np.ndarray) -> tuple[float, float]:
    """(sum of lengths, sum of squared lengths)."""
    values = np.asarray(lengths, dtype=np.float64)
    return float(values.sum()), float((values * values).sum())


def _sum_max_of_lines(a: tuple[float, float], b: tuple[float, float], n: int) -> float:
    """sum over k = 0..n-1 of max(a0 + a1*k, b0 + b1*k), exactly."""

    def line_sum(line: tuple[float, float], start: int, stop: int) -> float:
        count = stop - start
        return count * line[0] + line[1] * (start + stop - 1) * count / 2 if count > 0 else 0.0

    if a[1] == b[1]:
        return line_sum(a if a[0] >= b[0] else b, 0, n)
    if a[1] < b[1]:
        a, b = b, a  # a has the steeper slope: b is above it before they cross, a after
    crossing = (b[0] - a[0]) / (a[1] - b[1])  # a(k) >= b(k) exactly when k >= crossing
    split = min(n, max(0, math.ceil(crossing)))
    return line_sum(b, 0, split) + line_sum(a, split, n)


# -- loading ---------------------------------------------------------------------------------


def _values(entry: dict[str, Any], where: str) -> dict[str, Any]:
    """{name: value} of a YAML entry whose numbers are {value, source} pairs."""
    out = {}
    for key, item in entry.items():
        if isinstance(item, dict):
            if "value" not in item or not item.get("source"):
                raise ValueError(f"{where}.{key}: every number needs a value and a source")
            out[key] = item["value"]
        else:
            out[key] = item
    return out


def load_costs(path: str | Path | None = None) -> dict[str, Any]:
    """The parameter file (default: the shipped costs.yaml)."""
    path = Path(path or COSTS_FILE)
    if not path.is_file():
        raise ValueError(
            f"cost file {str(path)!r} does not exist; costs= takes a YAML file "
            f"laid out like {COSTS_FILE}"
        )
    costs = yaml.safe_load(path.read_text())
    if not isinstance(costs, dict):
        raise ValueError(f"cost file {str(path)!r} must hold a mapping laid out like {COSTS_FILE}")
    return costs


def accelerator(costs: dict[str, Any], name: str) -> Accelerator:
    entry = {k: v for k, v in _entry(costs, "accelerators", name).items() if k != "efficiency"}
    return Accelerator(name=name, **_values(entry, f"accelerators.{name}"))


def model_shape(costs: dict[str, Any], name: str) -> ModelShape:
    entry = _entry(costs, "models", name)
    values = _values(entry, f"models.{name}")
    return ModelShape(
        name=name, **{k: v for k, v in values.items() if k not in ("mem_fraction", "config")}
    )


def efficiency(costs: dict[str, Any], accelerator_name: str) -> Efficiency:
    """The shared factors, or the accelerator's own (an `efficiency` mapping in its entry)."""
    own = _entry(costs, "accelerators", accelerator_name).get("efficiency")
    if own is not None:
        return Efficiency(**_values(own, f"accelerators.{accelerator_name}.efficiency"))
    return Efficiency(**_values(costs["efficiency"], "efficiency"))


def cost_model(
    costs: dict[str, Any], accelerator_name: str, model_name: str, lora_rank: int = 0
) -> CostModel:
    values = _values(_entry(costs, "models", model_name), f"models.{model_name}")
    return CostModel(
        accelerator(costs, accelerator_name),
        model_shape(costs, model_name),
        efficiency(costs, accelerator_name),
        float(values["mem_fraction"]),
        lora_costs(costs, lora_rank),
        colocation(costs),
    )


def lora_costs(costs: dict[str, Any], rank: int) -> Lora | None:
    """The cost file's `lora` entry at `rank`; None for rank 0 (full fine-tuning)."""
    if rank <= 0:
        return None
    if "lora" not in costs:
        raise ValueError(f"lora_rank > 0 needs a `lora` entry in the cost file (see {COSTS_FILE})")
    values = _values(costs["lora"], "lora")
    return Lora(
        rank=rank,
        target_modules=tuple(values["target_modules"]),
        backward_weight_grad_share=float(values["backward_weight_grad_share"]),
    )


def colocation(costs: dict[str, Any]) -> Colocation | None:
    """The colocated switches' factors (None: the file has no `colocation` section)."""
    entry = costs.get("colocation")
    return None if entry is None else Colocation(**_values(entry, "colocation"))


def _entry(costs: dict[str, Any], section: str, name: str) -> dict[str, Any]:
    entries = costs.get(section, {})
    if name not in entries:
        raise ValueError(
            f"{name!r} is not in {section} of the cost file; known: {', '.join(sorted(entries))}"
        )
    return entries[name]
