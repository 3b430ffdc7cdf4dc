"""Fit the cost model's efficiency factors to timings measured on a real machine.

The cost model (sim/cost.py) prices a decode step, a prefill and a training step from an
accelerator's nominal peak FLOP/s and memory bandwidth, a model shape, and a handful of
efficiency factors. This module finds the factors that make those same formulas reproduce
measured timings, so that a measured machine is one more `accelerators` entry of the cost
file (with its own `efficiency` mapping), priced by the very code the simulator uses:

    decode + prefill -> mfu, hbm, step_overhead_s, seq_step_overhead_s,
                        decode_pack_attention
        least squares on relative error over every decode and prefill sample at once:
        a grid over (mfu, hbm) refined around its best point, and for each (mfu, hbm) the
        two fixed costs by non-negative linear least squares (the formulas are linear in
        them); layer_step_overhead_s is folded into step_overhead_s (one model shape);
        done with attention per context token and per (batch x context): the better fit
        is kept
    training     -> train_mfu, train_step_overhead_s, train_pack_attention
        linear least squares of seconds on (3 + r) * forward FLOPs / peak (see cost.py),
        with attention per sequence and over whole packs: the better fit is kept
    in-run steps -> a factor on the training price
        a real run's trainer steps (seconds seen by its controller, less the publication)
        over what the fitted model prices for the same batches, the median over steps:
        what training costs inside a run, on the batches a run trains, against the fit's
        price

Each fit reports its residual (root mean square of the relative errors) so the cost file can
say how well the form fits. Measuring is not done here (bench/calibration.py measures this
machine); nor is deciding what the fitted numbers mean for a cluster.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from collections.abc import Sequence

import numpy as np
from scipy.optimize import nnls

from areal.sim.cost import Accelerator, CostModel, Efficiency, ModelShape


@dataclass(frozen=True, kw_only=True)
class DecodeSample:
    """`steps` decode steps of `batch` sequences whose KV context totals `context` tokens at
    the first step (growing by `batch` per step) took `seconds`."""

    batch: int
    context: int
    steps: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class PrefillSample:
    """Prefilling sequences of these lengths (one call) took `seconds`."""

    lengths: tuple[int, ...]
    seconds: float


@dataclass(frozen=True, kw_only=True)
class TrainSample:
    """One training step on packed sequences of these lengths took `seconds`."""

    lengths: tuple[int, ...]
    seconds: float
    recompute_prox: bool = True


@dataclass(frozen=True, kw_only=True)
class GenerationFit:
    decode_pack_attention: bool
    mfu: float
    hbm: float
    step_overhead_s: float
    seq_step_overhead_s: float
    decode_rms: float
    """Root mean square of the relative errors over the decode samples."""
    prefill_rms: float


@dataclass(frozen=True, kw_only=True)
class TrainFit:
    train_mfu: float
    train_step_overhead_s: float
    train_pack_attention: bool
    rms: float


_BARE = Efficiency(
    mfu=1.0,
    hbm=1.0,
    link=1.0,
    step_overhead_s=0.0,
    layer_step_overhead_s=0.0,
    seq_step_overhead_s=0.0,
)


def _bare_model(
    acc: Accelerator, model: ModelShape, mfu: float, hbm: float, pack: bool
) -> CostModel:
    """The cost model with every fixed cost zero: only its roofline terms remain."""
    return CostModel(
        acc,
        model,
        dataclasses.replace(_BARE, mfu=mfu, hbm=hbm, decode_pack_attention=pack),
        mem_fraction=1.0,
    )


def _generation_system(
    acc: Accelerator,
    model: ModelShape,
    mfu: float,
    hbm: float,
    pack: bool,
    decode: Sequence[DecodeSample],
    prefill: Sequence[PrefillSample],
) -> tuple[np.ndarray, np.ndarray]:
    """(rows [n, 2], targets [n]) of seconds - roofline = step_overhead * a + seq * b,
    each row divided by its measured seconds (relative error)."""
    bare = _bare_model(acc, model, mfu, hbm, pack)
    rows, targets = [], []
    for s in decode:
        rows.append((s.steps, s.steps * s.batch))
        targets.append(s.seconds - bare.decode_s(s.batch, s.context, s.steps, tp=1))
    for p in prefill:
        rows.append((1, 0))
        targets.append(p.seconds - bare.prefill_s(p.lengths, tp=1))
    seconds = np.array([s.seconds for s in decode] + [s.seconds for s in prefill])
    return np.array(rows, dtype=np.float64) / seconds[:, None], np.array(targets) / seconds


def _solve(
    acc: Accelerator,
    model: ModelShape,
    mfu: float,
    hbm: float,
    pack: bool,
    decode: Sequence[DecodeSample],
    prefill: Sequence[PrefillSample],
) -> tuple[float, np.ndarray]:
    rows, targets = _generation_system(acc, model, mfu, hbm, pack, decode, prefill)
    overheads, residual = nnls(rows, targets)
    return residual, overheads


def fit_generation(
    acc: Accelerator,
    model: ModelShape,
    decode: Sequence[DecodeSample],
    prefill: Sequence[PrefillSample],
    grid: int = 25,
    rounds: int = 4,
) -> GenerationFit:
    """The factors that best reproduce the samples, with the better of the two attention
    forms (see the module docstring).

    Where the memory term never sets a step's time (the roofline's max picks compute in
    every sample), `hbm` is not determined by the data: the largest value that fits as well
    is returned (1.0 at most), the one that assumes least about memory."""
    if not decode or not prefill:
        raise ValueError(
            "fit_generation needs decode and prefill samples (got "
            f"{len(decode)} and {len(prefill)})"
        )
    per_context, per_batch_context = (
        _fit_generation_form(acc, model, decode, prefill, pack, grid, rounds)
        for pack in (False, True)
    )

    def error(f: GenerationFit) -> float:
        return f.decode_rms**2 * len(decode) + f.prefill_rms**2 * len(prefill)

    # the GPU engines' form unless the other is clearly better (not by rounding)
    return per_batch_context if error(per_batch_context) < 0.9 * error(per_context) else per_context


def _fit_generation_form(
    acc: Accelerator,
    model: ModelShape,
    decode: Sequence[DecodeSample],
    prefill: Sequence[PrefillSample],
    pack: bool,
    grid: int,
    rounds: int,
) -> GenerationFit:
    low, high = np.log10([1e-6, 1e-6]), np.log10([1.0, 1.0])
    best = (float("inf"), 0.0, 0.0)
    for _ in range(rounds):
        for log_mfu in np.linspace(low[0], high[0], grid):
            for log_hbm in np.linspace(low[1], high[1], grid)[::-1]:  # ties: the largest hbm
                residual, _ = _solve(acc, model, 10**log_mfu, 10**log_hbm, pack, decode, prefill)
                if residual < best[0] * (1 - 1e-9):
                    best = (residual, log_mfu, log_hbm)
        span = (high - low) / (grid - 1) * 2  # two grid cells either side of the best
        centre = np.array(best[1:])
        low, high = np.maximum(centre - span, -9.0), np.minimum(centre + span, 0.0)
    mfu, hbm = 10 ** best[1], 10 ** best[2]
    _, (step, seq) = _solve(acc, model, mfu, hbm, pack, decode, prefill)
    fitted = CostModel(
        acc,
        model,
        dataclasses.replace(
            _BARE,
            mfu=mfu,
            hbm=hbm,
            step_overhead_s=step,
            seq_step_overhead_s=seq,
            decode_pack_attention=pack,
        ),
        1.0,
    )
    decode_err = [fitted.decode_s(s.batch, s.context, s.steps, 1) / s.seconds - 1 for s in decode]
    prefill_err = [fitted.prefill_s(s.lengths, 1) / s.seconds - 1 for s in prefill]
    return GenerationFit(
        decode_pack_attention=pack,
        mfu=float(mfu),
        hbm=float(hbm),
        step_overhead_s=float(step),
        seq_step_overhead_s=float(seq),
        decode_rms=_rms(decode_err),
        prefill_rms=_rms(prefill_err),
    )


def fit_training(
    acc: Accelerator,
    model: ModelShape,
    samples: Sequence[TrainSample],
    micro_batch_tokens: int = 8192,
) -> TrainFit:
    """seconds = train_step_overhead_s + the cost model's training FLOPs / (peak *
    train_mfu), fitted on relative error (non-negative coefficients), once with attention
    per sequence and once over whole packs (`train_pack_attention`, see cost.py): the better fit
    decides."""
    if len(samples) < 2:
        raise ValueError(
            f"fit_training needs at least 2 samples of different sizes, got {len(samples)}"
        )
    seconds = np.array([s.seconds for s in samples])
    fits = []
    for pack in (False, True):
        bare = CostModel(acc, model, dataclasses.replace(_BARE, train_pack_attention=pack), 1.0)
        flops_s = np.array(
            [bare.train_s(s.lengths, 1, 1, s.recompute_prox, micro_batch_tokens) for s in samples]
        )  # FLOPs / peak: seconds at train_mfu 1
        rows = np.column_stack([np.ones(len(samples)), flops_s])
        (overhead, inverse_mfu), _ = nnls(rows / seconds[:, None], np.ones(len(samples)))
        if inverse_mfu <= 0:
            continue
        predicted = rows @ np.array([overhead, inverse_mfu])
        fits.append(
            TrainFit(
                train_mfu=float(1 / inverse_mfu),
                train_step_overhead_s=float(overhead),
                train_pack_attention=pack,
                rms=_rms(predicted / seconds - 1),
            )
        )
    if not fits:
        raise ValueError(
            "training time does not grow with the tokens trained: the samples "
            "cannot give a training rate; measure batches of more different sizes"
        )
    return min(fits, key=lambda f: f.rms)


@dataclass(frozen=True, kw_only=True)
class SlowdownFit:
    factor: float
    """The median over steps of the step's training time over `cost`'s price of it."""
    rms: float
    """Root mean square of each step's relative error at that factor."""
    steps: int


def fit_train_slowdown(
    cost: CostModel,
    samples: Sequence[TrainSample],
    *,
    num_minibatches: int = 1,
    micro_batch_tokens: int = 8192,
    publishes: bool = True,
) -> SlowdownFit:
    """The factor on `cost`'s training price (`train_s`) of the steps of a real run
    (`samples`: each step's batch lengths and the seconds its controller waited for the
    trainer's answer, less (`publishes`) the weights' publication at its own price, as a
    simulated trainer rank 0 spends a step: sim/workers.py). The median of the steps'
    factors: on a shared machine a few steps slowed by a process outside the run move it
    less than they would move a total."""
    if not samples:
        raise ValueError("fit_train_slowdown needs at least one step")
    train = np.array(
        [
            cost.train_s(s.lengths, num_minibatches, 1, s.recompute_prox, micro_batch_tokens)
            for s in samples
        ]
    )
    publish = cost.publish_s(colocated=False) if publishes else 0.0
    measured = np.array([s.seconds for s in samples])
    factor = float(np.median((measured - publish) / train))
    return SlowdownFit(
        factor=factor, rms=_rms((factor * train + publish) / measured - 1), steps=len(samples)
    )


def _rms(errors: Sequence[float] | np.ndarray) -> float:
    values = np.asarray(errors, dtype=np.float64)
    return float(np.sqrt(np.mean(values * values))) if len(values) else 0.0
