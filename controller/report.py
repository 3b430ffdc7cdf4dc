"""Turning what the controller saw into metrics records: per step, per evaluation, per run.

`StepReport` accumulates between training steps (tokens generated, interruptions, weight
update pauses, reward verdicts) and produces the step record written to metrics.jsonl; the
summary states held-out accuracy before and after training and the wall time.
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import numpy as np

from areal import clock
from areal.algorithms.shaping import shaping_in_force, shaping_metrics
from areal.evaluation import summarize
from areal.messages import Generated, WeightsUpdated
from areal.tasks.base import Verdict
from areal.types import PROMPT_VERSION, Trajectory
from areal.controller.episodes import episode_metrics
from areal.config import RunConfig
from areal.controller.ledger import STEP_COLUMNS, Dropped, Group, trajectory_step_values


class StepColumns(NamedTuple):
    """A complete training group's part of a step record, read off its samples once."""

    columns: np.ndarray
    """[trajectories, 6] float64: each trajectory's oldest version, tokens, prompt tokens,
    reward, whether it was cut at the length limit, interruptions."""
    num_ok: int
    """Samples whose verdict is ok."""
    episodes: bool
    """Whether a trajectory is an episode's (the record's episode metrics read them)."""


def step_columns(group: Group) -> StepColumns:
    """`group`'s part of its step record (a complete training group: rewarded, never to
    change), computed on the first call and kept on the group (`Group.step_columns`); the
    controller asks as the group completes (`StepReport.completed`). The ledger wrote each
    sample's values as its completion and its reward came in (`Group.step_values`); a group
    with an agent episode's segments (several trajectories a sample), or one the ledger did
    not build, is read off its trajectories and samples."""
    if group.step_columns is not None:
        return group.step_columns
    if not group.segmented and len(group.step_values) == STEP_COLUMNS * len(group.samples):
        group.step_columns = StepColumns(
            columns=np.frombuffer(group.step_values, np.float64).reshape(-1, STEP_COLUMNS),
            num_ok=group.num_ok,
            episodes=group.episodes,
        )
    else:
        trajectories = group.trajectories()
        group.step_columns = StepColumns(
            columns=np.array(
                [trajectory_step_values(t) for t in trajectories], dtype=np.float64
            ).reshape(-1, STEP_COLUMNS),
            num_ok=sum(s.verdict is Verdict.OK for s in group.samples),
            episodes=any(t.episode for t in trajectories),
        )
    return group.step_columns


class StepReport:
    def __init__(self) -> None:
        self._window_start = clock.now()
        self._train_start: float | None = None
        self._last_step_at: float | None = None
        self._generated_tokens = 0
        self._answers = 0
        self._answered = 0
        self._trained_tokens = 0
        self._pauses: list[float] = []
        self._verdicts: collections.Counter = collections.Counter()
        self.num_interruptions = 0
        self._dropped: collections.Counter = collections.Counter()
        self._dropped_tokens = 0
        self._dropped_positions: list[int] = []
        self.dropped_total: collections.Counter = collections.Counter()
        """Groups dropped over the run, by reason."""
        self.dropped_tokens_total = 0

    def start_training(self) -> None:
        """The clock of training throughput starts (after workers are up and the first
        evaluation is done); generation counted from here on too."""
        self._train_start = self._window_start = clock.now()
        self._generated_tokens = 0

    def train_elapsed(self) -> float:
        return clock.now() - self._train_start if self._train_start else 0.0

    def on_generated(self, trajectory: Trajectory, msg: Generated) -> None:
        """Every completed generation (trained or not) counts toward throughput (sampled
        tokens only: not an episode's observations)."""
        # An agent episode's earlier segments are not `trajectory`: count from the message.
        if msg.segment_prompt_lens and msg.loss_mask is not None:
            num_tokens = int(msg.loss_mask.sum())
        else:
            num_tokens = trajectory.num_model_tokens
        self.on_generated_tokens(num_tokens, msg.num_interruptions)

    def on_generated_tokens(self, num_tokens: int, num_interruptions: int) -> None:
        """Completions generated: `num_tokens` sampled tokens, `num_interruptions` by weight
        updates (one Generated's, or a Completions' summed)."""
        self._generated_tokens += num_tokens
        self.num_interruptions += num_interruptions

    def on_answer(self, num_completions: int) -> None:
        """A rollout worker's answer (a Generated, or a Completions of several) arrived."""
        self._answers += 1
        self._answered += num_completions

    def on_scored(self, verdict: Verdict) -> None:
        self._verdicts[verdict.value] += 1

    def on_scored_all(self, verdicts: list[Verdict]) -> None:
        """`on_scored` of each of `verdicts` (a Scored's)."""
        self._verdicts.update([verdict.value for verdict in verdicts])

    def on_dropped(self, reason: str, dropped: Dropped) -> None:
        """A training group was dropped (never trained on) for `reason`."""
        self._dropped[reason] += 1
        self.dropped_total[reason] += 1
        self._dropped_tokens += dropped.num_tokens
        self._dropped_positions.append(dropped.group.position)
        self.dropped_tokens_total += dropped.num_tokens

    def completed(self, group: Group) -> None:
        """A training group got its last reward and goes to the buffer: its part of the step
        record is read now (`step_columns`)."""
        step_columns(group)

    def on_weights_updated(self, msg: WeightsUpdated) -> None:
        self._pauses.append(msg.pause_s)

    def step_record(
        self,
        step: int,
        version: int,
        groups: list[Group],
        stats: dict[str, float],
        train_s: float,
        waited_s: float,
        *,
        cfg: RunConfig,
        in_flight: int,
        score_queue: int,
        buffered: int,
        started: float,
    ) -> dict[str, Any]:
        """The record of training step `step`, which published `version`; `in_flight`,
        `score_queue`, `buffered`: samples in the ledger, waiting for a reward worker, and
        trajectories in the buffer now; `started`: when the run started."""
        now = self._last_step_at = clock.now()
        trained_version = version - 1  # the batch was trained at the version before publishing
        parts = [step_columns(g) for g in groups]  # kept since each group completed
        oldest, num_tokens, num_prompt, rewards, truncated, interruptions = np.concatenate(
            [part.columns for part in parts]
        ).T
        num_trajectories = len(oldest)
        staleness_values, staleness_counts = np.unique(
            trained_version - oldest.astype(np.int64), return_counts=True
        )
        out_lens = (num_tokens - num_prompt).astype(np.int64)
        num_ok = sum(part.num_ok for part in parts)
        num_samples = sum(len(g.samples) for g in groups)
        batch_tokens = int(num_tokens.sum())
        assert self._train_start is not None, "a step record before start_training()"
        self._trained_tokens += batch_tokens
        window = max(now - self._window_start, 1e-9)
        record: dict[str, Any] = {
            "version": version,
            "rollout/reward_mean": float(rewards.mean()),
            "rollout/accuracy": num_ok / num_samples,
            "rollout/completion_len_mean": float(out_lens.mean()),
            "rollout/completion_len_max": int(out_lens.max()),
            "rollout/truncated_fraction": float(truncated.mean()),
            "rollout/interruptions": int(interruptions.sum()),
            "rollout/in_flight": in_flight,
            # rollout.max_queued at work: about max_queued + 1 while workers are full
            "rollout/completions_per_answer": self._answered / max(self._answers, 1),
            "rollout/weight_pause_s_mean": float(np.mean(self._pauses)) if self._pauses else 0.0,
            "staleness/hist": {
                str(int(k)): int(n) for k, n in zip(staleness_values, staleness_counts, strict=True)
            },
            "staleness/mean": float(np.dot(staleness_values, staleness_counts) / num_trajectories),
            "staleness/max": int(staleness_values[-1]),
            "reward/verdicts": dict(self._verdicts),
            "reward/queue": score_queue,
            "buffer/trajectories": buffered,
            "perf/gen_tokens_per_s": self._generated_tokens / window,
            "perf/train_tokens_per_s": batch_tokens / max(train_s, 1e-9),
            "perf/trained_tokens_per_s": self._trained_tokens / max(now - self._train_start, 1e-9),
            "perf/train_s": train_s,
            "perf/train_wait_s": waited_s,
            "perf/elapsed_s": now - started,
            "perf/train_elapsed_s": now - self._train_start,
            "perf/trained_tokens": self._trained_tokens,
        }
        record["rollout/dropped_groups"] = sum(self._dropped.values())
        record.update({f"rollout/dropped_groups/{k}": v for k, v in self._dropped.items()})
        record["rollout/dropped_tokens"] = self._dropped_tokens
        if any(part.episodes for part in parts) or shaping_in_force(cfg):  # else both are {}
            trajs = [t for g in groups for t in g.trajectories()]
            record.update(episode_metrics(trajs, "episode/"))
            record.update(shaping_metrics(trajs, cfg))
        # Draw positions (RunSetup) of the prompt groups trained in this step and dropped
        # since the last one: every admitted group is accounted for by the records alone.
        record["rollout/trained_positions"] = [g.position for g in groups]
        record["rollout/dropped_positions"] = self._dropped_positions
        record.update({f"train/{k}": v for k, v in stats.items()})
        self._window_start, self._generated_tokens = now, 0
        self._answers = self._answered = 0
        self._pauses, self._verdicts = [], collections.Counter()
        self._dropped, self._dropped_tokens = collections.Counter(), 0
        self._dropped_positions = []
        return record

    def summary(
        self, before: dict[str, Any], after: dict[str, Any], wall_s: float, steps: int, **run: Any
    ) -> dict[str, Any]:
        """The run's summary; `run`: what the controller adds of its own (run_dir, mode,
        final_version, malformed_messages, num_drawn, untrained_positions)."""
        # Training time runs from the start of training to the end of the last step (the
        # final evaluation is not part of it).
        train_s = (
            (self._last_step_at - self._train_start)
            if self._last_step_at and self._train_start is not None
            else 0.0
        )
        return {
            "run_dir": str(run["run_dir"]),
            "mode": run["mode"],
            "steps": steps,
            "final_version": run["final_version"],
            "eval_pass@1_before": before["eval/pass@1"],
            "eval_pass@1_after": after["eval/pass@1"],
            "eval_pass@1_gain": after["eval/pass@1"] - before["eval/pass@1"],
            "wall_time_s": wall_s,
            "train_time_s": train_s,
            "trained_tokens": self._trained_tokens,
            "trained_tokens_per_s": self._trained_tokens / train_s if train_s else 0.0,
            "interruptions_total": self.num_interruptions,
            "malformed_messages": run["malformed_messages"],
            "dropped_groups": dict(self.dropped_total),
            "num_drawn": run["num_drawn"],
            "untrained_positions": run["untrained_positions"],
            "rollout/dropped_positions": list(self._dropped_positions),  # after the last step
            "dropped_tokens": self.dropped_tokens_total,
        }


def eval_record(groups: list[Group], version: int, seconds: float) -> dict[str, Any]:
    groups = sorted(groups, key=lambda g: g.prompt.prompt_id)
    record: dict[str, Any] = {"version": version, "eval/seconds": seconds}
    # A periodic evaluation shares the rollout workers with training; in async mode its
    # sequences may be interrupted and finish under newer weights. Say which ones sampled.
    # Read per trajectory, off its runs: a round at cluster scale holds tens of millions of
    # tokens, which a loop over each (or joining each trajectory's arrays) would spend
    # seconds of the event loop on.
    trajectories = [s.generated for g in groups for s in g.samples]
    sampled = [t for t in trajectories if t.oldest_version() != PROMPT_VERSION]
    if sampled:
        record["eval/token_version_min"] = float(min(t.oldest_version() for t in sampled))
        record["eval/token_version_max"] = float(max(t.newest_version() for t in sampled))
    record.update(
        summarize(
            [[s.judged for s in g.samples] for g in groups],
            [[s.generated.reward for s in g.samples] for g in groups],
        )
    )
    record.update(episode_metrics(trajectories, "eval/"))
    return record


def summary_lines(summary: dict[str, Any]) -> list[str]:
    before, after = summary["eval_pass@1_before"], summary["eval_pass@1_after"]
    resumed = summary.get("resumed_after_step")
    steps = (
        f"{summary['steps']} steps"
        if resumed is None
        else f"steps {resumed + 1}-{summary['steps']} (resumed)"
    )
    return [
        "",
        f"run finished: {steps} in {summary['wall_time_s']:.0f} s "
        f"({summary['mode']} mode), results in {summary['run_dir']}",
        f"held-out accuracy (pass@1): {100 * before:.1f}% before -> {100 * after:.1f}% after "
        f"training ({100 * (after - before):+.1f} points)",
        f"trained {summary['trained_tokens']} tokens at {summary['trained_tokens_per_s']:.0f} "
        f"tokens/s; {summary['interruptions_total']} interruptions by weight updates",
    ]
