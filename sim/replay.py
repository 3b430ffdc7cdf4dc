"""A workload that replays the prompt and completion lengths of a real run.

To check the simulator against a real run (areal.sim.calibrate, bench/calibration.py) the
simulated rollout servers must generate what the real ones did: the same number of tokens
for the same sample of the same prompt. A real run started with `logging.save_batches=true`
leaves every trained batch in `<run_dir>/batches/step_*.npz`, and its step records in
`metrics.jsonl` say which draw positions those batches' groups came from
(`rollout/trained_positions`). The simulated task numbers its prompts by draw position too
(sim/workload.py: prompt key = position), so

    prompt key k, sample i  ->  the completion length of sample i of the group drawn k-th

Prompts drawn but never trained in the real run (an async run ends with groups in flight)
get lengths drawn from the run's own lengths, deterministically from (seed, key, sample).
Rewards and reward latency stay those of `Workload` (they do not set how long anything
takes, except the latency, given as a parameter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from areal.controller.setup import saved_batch_path
from areal.records import read_records
from areal.sim.workload import Workload


@dataclass(frozen=True, kw_only=True)
class ReplayWorkload(Workload):
    completions: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Prompt key -> completion length of each sample, in sample order."""
    prompts: dict[int, int] = field(default_factory=dict)
    """Prompt key -> prompt tokens."""

    def _pool(self) -> tuple[list[int], list[int]]:
        """(every completion length, every prompt length), sorted."""
        return (
            sorted(n for lengths in self.completions.values() for n in lengths),
            sorted(self.prompts.values()),
        )

    def _pick(self, values: list[int], *key: Any) -> int:
        """One of `values`, uniformly, as a function of (seed, *key) only."""
        uniform = 0.5 * (1 + math.erf(self._normal(*key) / math.sqrt(2)))
        return values[min(int(uniform * len(values)), len(values) - 1)]

    def prompt_tokens(self, prompt_key: int) -> int:
        if prompt_key in self.prompts:
            return self.prompts[prompt_key]
        return self._pick(self._pool()[1], "replay-prompt", prompt_key)

    def completion_tokens(self, prompt_key: int, sample: str, max_new_tokens: int) -> int:
        lengths = self.completions.get(prompt_key, ())
        index = int(sample)
        length = (
            lengths[index]
            if index < len(lengths)
            else self._pick(self._pool()[0], "replay-completion", prompt_key, sample)
        )
        return max(1, min(max_new_tokens, length))

    @classmethod
    def from_run(
        cls, run_dir: str | Path, reward_latency_s: float, seed: int = 1
    ) -> ReplayWorkload:
        """The lengths of a real run's trained batches (it ran with logging.save_batches)."""
        run_dir = Path(run_dir)
        # The run's history: a resumed run's superseded steps were trained again (their
        # saved batches are the later ones), and a torn last line is skipped.
        steps = [r for r in read_records(run_dir) if r.get("kind") == "step"]
        completions: dict[int, tuple[int, ...]] = {}
        prompts: dict[int, int] = {}
        for record in steps:
            path = saved_batch_path(run_dir, int(record["step"]))
            if not path.is_file():
                raise ValueError(
                    f"{path} is missing: replaying a run needs every trained "
                    "batch; run it with logging.save_batches=true"
                )
            groups = batch_groups(np.load(path))
            positions = record["rollout/trained_positions"]
            if len(groups) != len(positions):
                raise ValueError(
                    f"{path}: {len(groups)} groups, but the step record names "
                    f"{len(positions)} trained positions"
                )
            for position, (prompt_len, lengths) in zip(positions, groups, strict=True):
                completions[int(position)] = lengths
                prompts[int(position)] = prompt_len
        if not completions:
            raise ValueError(f"{run_dir} holds no trained batch to replay")
        return cls(
            prompt_median_tokens=float(np.median(list(prompts.values()))),
            prompt_sigma=0.0,
            prompt_max_tokens=max(prompts.values()),
            completion_median_tokens=float(
                np.median([n for lengths in completions.values() for n in lengths])
            ),
            completion_sigma_prompt=0.0,
            completion_sigma_sample=0.0,
            reward_latency_s=reward_latency_s,
            seed=seed,
            completions=completions,
            prompts=prompts,
        )


def batch_groups(batch: Any) -> list[tuple[int, tuple[int, ...]]]:
    """(prompt tokens, completion lengths in sample order) of each group of a saved packed
    batch, in the order the groups appear. Sampled tokens carry a version >= 0; the prompt
    (and an episode's observations, none here) carry -1."""
    cu_seqlens, versions, group_ids = batch["cu_seqlens"], batch["versions"], batch["group_ids"]
    sampled = (
        np.add.reduceat((versions >= 0).astype(np.int64), cu_seqlens[:-1])
        if len(versions)
        else np.zeros(0, dtype=np.int64)
    )
    totals = np.diff(cu_seqlens)
    order: dict[int, list[int]] = {}
    for seq, group_id in enumerate(group_ids.tolist()):
        order.setdefault(group_id, []).append(seq)
    return [
        (int(totals[seqs[0]] - sampled[seqs[0]]), tuple(int(sampled[s]) for s in seqs))
        for seqs in order.values()
    ]
