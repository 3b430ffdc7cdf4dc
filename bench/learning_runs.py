"""What the learning benches share (ablation.py, paired.py): one real training run as a
result worth keeping, the warm-started model every run starts from, and the mechanism's
numbers read from the runs' step records.

A run's result (JSON, kept in the bench's cells.json) holds held-out pass@1 before and
after, the training time, the realised staleness of every trained trajectory, and per step
the training reward and the mechanism's metrics (`MECHANISM`), so that tables and plots are
made again from saved results without running anything.
"""

from __future__ import annotations

import asyncio
import collections
import math
import shutil
from pathlib import Path
from typing import Any

from areal.config import load_config
from areal.controller import Controller
from areal.intervals import t_interval
from areal.models.warmstart import ensure_warm_model

MECHANISM = {
    "kl_prox_new": "KL(prox || new)",
    "kl_behav_new": "KL(behav || new)",
    "kl_behav_prox": "KL(behav || prox)",
    "behav_w_outside_clip_frac": "w outside clip",
    "clip_frac": "clipped",
    "clip_low_frac": "clipped low",
    "clip_high_frac": "clipped high",
    "unclipped_outside_frac": "open side",
    "ratio_max": "max ratio",
    "behav_cap_frac": "w > cap (masked)",
    "grad_norm": "grad norm",
}
"""Step-record keys (train/...) of the mechanism, and their short names in tables. KLs are
the k3 estimates of areal.algorithms.movement (needs trainer.measure_movement=true)."""
W_FRACS = "behav_w_frac/"
"""Prefix of the behaviour-weight distribution's bins (train/behav_w_frac/<bin>)."""


def warm_model(setting: list[str], overrides: list[str]) -> Path:
    """The warm-started model every run starts from (built once with seed 1: the run seed
    does not change it)."""
    cfg = load_config(overrides=[*setting, "seed=1", *overrides])
    return ensure_warm_model(cfg) if cfg.model.path is None else Path(cfg.model.path)


async def run_training(overrides: list[str]) -> dict[str, Any]:
    """One real run (controller, rollout, reward and trainer processes) from scratch."""
    cfg = load_config(overrides=overrides)
    # A run without a saved result starts afresh: a directory left by an interrupted run
    # would mix its metrics and weight versions into this one.
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    ctl = Controller(cfg)
    run = asyncio.create_task(ctl.run())
    staleness: collections.Counter = collections.Counter()
    steps: list[dict[str, float]] = []
    async for record in ctl.events():
        if record["kind"] == "step":
            staleness.update({int(k): v for k, v in record["staleness/hist"].items()})
            kept = {
                "step": record["step"],
                "reward": record["rollout/reward_mean"],
                "staleness": record["staleness/mean"],
            }
            kept.update(
                {
                    k: v
                    for k, v in record.items()
                    if k.startswith("train/") and (k[6:] in MECHANISM or W_FRACS in k)
                }
            )
            steps.append(kept)
    summary = await run
    return {
        "pass@1": summary["eval_pass@1_after"],
        "pass@1_before": summary["eval_pass@1_before"],
        "train_time_s": summary["train_time_s"],
        "steps": summary["steps"],
        "staleness": dict(sorted(staleness.items())),
        "per_step": steps,
    }


def staleness_line(results: list[dict]) -> str:
    """'mean 3.5  0:192 1:216 ...' over every trajectory trained in `results`."""
    total: collections.Counter = collections.Counter()
    for result in results:
        total.update({int(k): v for k, v in result["staleness"].items()})
    if not total:
        return ""
    mean = sum(k * v for k, v in total.items()) / sum(total.values())
    return f"mean {mean:4.1f}  " + " ".join(f"{k}:{v}" for k, v in sorted(total.items()))


def mechanism_means(results: list[dict]) -> dict[str, float]:
    """Per mechanism key: the mean over steps of each run, then over runs (NaN if absent)."""
    out = {}
    keys = list(MECHANISM) + sorted(
        {k[6:] for r in results for s in r.get("per_step", []) for k in s if W_FRACS in k}
    )
    for key in keys:
        per_run = []
        for result in results:
            values = [s[f"train/{key}"] for s in result.get("per_step", []) if f"train/{key}" in s]
            if values:
                per_run.append(sum(values) / len(values))
        out[key] = sum(per_run) / len(per_run) if per_run else math.nan
    return out


def mechanism_table(rows: dict[str, list[dict]]) -> str:
    """One row per label: the mechanism's means (over steps, then seeds)."""
    means = {label: mechanism_means(results) for label, results in rows.items()}
    keys = [k for k in MECHANISM if any(not math.isnan(m[k]) for m in means.values())]
    bins = sorted({k for m in means.values() for k in m if W_FRACS in k}, key=_bin_order)
    width = max([len(label) for label in rows] + [10])
    head = f"{'':<{width}}" + "".join(f"{MECHANISM[k]:>17}" for k in keys)
    lines = [head, "-" * len(head)]
    for label, m in means.items():
        lines.append(f"{label:<{width}}" + "".join(f"{_fmt(m[k]):>17}" for k in keys))
    if bins:
        lines += [
            "",
            "behaviour weight w = pi_prox / pi_behav (recomputed): fraction of loss tokens per bin",
        ]
        head = f"{'':<{width}}" + "".join(f"{b[len(W_FRACS) :]:>11}" for b in bins)
        lines += [head, "-" * len(head)]
        for label, m in means.items():
            lines.append(
                f"{label:<{width}}" + "".join(f"{_fmt(m.get(b, math.nan)):>11}" for b in bins)
            )
    return "\n".join(lines)


def _bin_order(key: str) -> float:
    label = key.split("/")[-1]
    if label.startswith("<"):
        return -1.0
    return float(label.lstrip(">=").split("-")[0])


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"


def reward_band(results: list[dict]) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps, mean, low, high) of the training reward over runs, per step: the mean and its
    95% t-interval (the band of the plots); steps that not every run has are left out."""
    by_step: dict[int, list[float]] = collections.defaultdict(list)
    for result in results:
        for s in result.get("per_step", []):
            by_step[s["step"]].append(s["reward"])
    steps = [k for k in sorted(by_step) if len(by_step[k]) == len(results)]
    mean, low, high = [], [], []
    for k in steps:
        ci = t_interval(by_step[k])
        mean.append(ci.mean)
        low.append(ci.low if ci.n > 1 else ci.mean)
        high.append(ci.high if ci.n > 1 else ci.mean)
    return steps, mean, low, high
