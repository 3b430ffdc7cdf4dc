"""The controller's book of work: every sample request, every prompt group, the replay buffer.

A prompt group (the `group_size` samples of one prompt) moves through:

    admitted -> each sample: pending -> generating (on a rollout worker)
                                     -> scoring (on a reward worker) -> done
    all samples done -> training groups go to the replay buffer; eval groups to their round

Nothing is ever lost: a sample whose worker is lost goes back to `pending` (generation)
or is re-sent for scoring, under a new attempt id so that a late answer from the lost worker
is recognised and ignored. The buffer hands out whole groups, oldest first, each at most
once (`trained_group_ids` proves it). A training group may be dropped on purpose, at any
stage (`drop_group`: its rewards carry no signal, it grew too stale, its reward could not be
computed); it is then never trained on (`dropped_group_ids`), and every admitted group ends
up in exactly one of the two lists or still in the ledger. Pure bookkeeping: no sockets, no
clocks of its own.
"""

from __future__ import annotations

import array
import collections
import enum
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple
from collections.abc import Callable, Iterable

import numpy as np

from areal.messages import Completions, EpisodeEnd, FinishReason, Generated
from areal.tasks.base import Prompt, RewardOutcome, Verdict
from areal.types import Trajectory, VersionRuns

if TYPE_CHECKING:
    from areal.controller.report import StepColumns

_INT32, _FLOAT32 = np.dtype(np.int32), np.dtype(np.float32)
"""A trajectory's own dtypes. numpy keeps one object of each built-in (native-order) dtype,
so `is` tells an array's dtype; one of another byte order is another object."""


class Stage(str, enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    SCORING = "scoring"
    DONE = "done"


class Purpose(str, enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


@dataclass(kw_only=True, slots=True)
class Sample:
    group_id: int
    index: int
    attempt: int = 0
    stage: Stage = Stage.PENDING
    worker: bytes | None = None
    """Identity of the worker holding it now (rollout while generating, reward while scoring)."""
    trajectory: Trajectory | None = None
    """Its trajectory once built: at once from a Generated, at the first read of `generated`
    from a recorded completion (`recorded`). Read it through `generated`."""
    verdict: Verdict | None = None
    submitted_at: float = 0.0
    num_score_failures: int = 0
    """Checks of it that ended without a verdict (controller/reward_faults.py)."""
    segments: list[Trajectory] = field(default_factory=list)
    """Agent episodes: the training segments before the last (`trajectory`), each with its
    own prompt and reward (areal.tasks.agent); empty for everything else."""
    recorded: Recorded | None = field(default=None, compare=False, repr=False)
    """A completion of a Completions message, recorded (`Ledger.finish_completions`) and
    not yet read as a Trajectory: where it lies in the message. `generated` builds the
    trajectory from it when first read, usually on the thread that packs the batch."""
    request_id: str = field(init=False)
    """'g<group>-s<index>-a<attempt>': written once per attempt, read for every message
    about the sample (thousands of Generates and Generateds per step at cluster scale)."""

    def __post_init__(self) -> None:
        self.request_id = f"g{self.group_id}-s{self.index}-a{self.attempt}"

    @property
    def generated(self) -> Trajectory:
        """Its trajectory, read once it is generated (the last segment of an agent
        episode); built on the first read from a recorded completion. A training sample's is
        first read on the packing thread (controller/train_driver.py), which holds the batch's
        groups alone once they leave the buffer, so no other thread builds it at once."""
        if self.trajectory is None:
            assert self.recorded is not None, f"{self.request_id} is not generated"
            self.trajectory = _recorded_trajectory(self, self.recorded)
        return self.trajectory

    def release_trajectory(self) -> None:
        """Forget the trajectory built from its recorded completion (`generated` builds it
        again if read; one from a Generated, which has no recorded completion, is kept). The
        packing thread, which built it, frees it there (`TrainDriver._pack`)."""
        if self.recorded is not None:
            self.trajectory = None

    def message_index(self) -> int:
        """Which completion of the Completions that recorded it (`recorded`) it is."""
        assert self.recorded is not None, f"{self.request_id} was not recorded from a message"
        return self.recorded[1]

    @property
    def is_generated(self) -> bool:
        """Past generation: its trajectory is built, or its completion recorded."""
        return self.trajectory is not None or self.recorded is not None

    @property
    def is_episode(self) -> bool:
        """Generated as an episode (a recorded completion never is)."""
        return self.trajectory is not None and bool(self.trajectory.episode)

    def num_output_tokens(self) -> int:
        """Tokens generated for it (generated), every segment's, without building its
        trajectory."""
        if self.trajectory is None and self.recorded is not None:
            return self.recorded[3] - self.recorded[2]
        return sum(t.num_tokens - t.num_prompt_tokens for t in self.trajectories())

    def output_ids(self) -> np.ndarray:
        """Its completion's token ids, [T] (generated), without building its trajectory."""
        if self.trajectory is None and self.recorded is not None:
            msg, _, start, end = self.recorded[:4]
            return msg.output_ids[start:end]
        return self.generated.output_ids

    @property
    def judged(self) -> Verdict:
        """Its verdict, read once it is scored."""
        assert self.verdict is not None, f"{self.request_id} is not scored"
        return self.verdict

    def trajectories(self) -> list[Trajectory]:
        """Its training sequences: the earlier segments of an agent episode, then the last
        (a generated sample's)."""
        return [*self.segments, self.generated]

    def next_attempt(self) -> None:
        """Under a new request id: a late answer to the old one is then stale."""
        self.attempt += 1
        self.__post_init__()

    @classmethod
    def first_attempts(cls, group_id: int, size: int) -> list[Sample]:
        """A new group's `size` samples, pending at their first attempt: equal to
        `Sample(group_id=group_id, index=i)` for each i, built with the fields set directly
        rather than through the dataclass's keyword handling, defaults and `__post_init__`
        (the ledger admits thousands of groups a step at cluster scale, and this was most
        of `Ledger.add_group`'s cost). tests/controller/test_ledger.py holds the two equal."""
        prefix, pending, new = f"g{group_id}", Stage.PENDING, cls.__new__
        samples = []
        for index, suffix in enumerate(_first_suffixes(size)):
            sample = new(cls)
            sample.group_id, sample.index, sample.attempt = group_id, index, 0
            sample.stage, sample.worker = pending, None
            sample.trajectory, sample.verdict, sample.recorded = None, None, None
            sample.submitted_at, sample.num_score_failures = 0.0, 0
            sample.segments, sample.request_id = [], prefix + suffix
            samples.append(sample)
        return samples


@functools.cache
def _first_suffixes(size: int) -> tuple[str, ...]:
    """'-s<index>-a0' for each index of a group of `size`: the part of a first attempt's
    request id after its group's (one string a sample, built once a group size)."""
    return tuple(f"-s{index}-a0" for index in range(size))


@dataclass(kw_only=True)
class Dropped:
    """What dropping a group released, for the caller to settle with workers and staleness."""

    group: Group
    generating: dict[bytes, list[str]]
    """Request ids being generated, by rollout worker identity (to cancel)."""
    num_unfinished: int
    """Samples not yet generated (pending or generating): in flight for the staleness count."""
    num_finished: int
    """Samples generated (being scored or done): buffered for the staleness count."""
    num_tokens: int
    """Completion tokens generated for the group and thrown away."""


@dataclass(kw_only=True, slots=True)
class Group:
    group_id: int
    purpose: Purpose
    prompt: Prompt
    prompt_ids: np.ndarray
    admitted_version: int
    samples: list[Sample] = field(default_factory=list)
    num_generated: int = 0
    """Samples past generation (scoring or done); a sample never goes back from there, so
    `Ledger.unscored` needs no look at the others until the last is generated."""
    num_done: int = 0
    """Samples done (scored), counted so that each sample scored does not look at all of
    its group's (`Ledger.finish_scoring`)."""
    seeds: list[int] | None = None
    """Its samples' sampling seeds, by index (areal.seeds), the same for every attempt:
    written at its first dispatch (controller/generation.py), None before."""
    eval_round: int = -1
    position: int = -1
    """Training groups: the prompt's draw position in the task's stream (RunSetup)."""
    step_values: array.array = field(default_factory=lambda: array.array("d"))
    """Its part of the step record, written as it happens: for each sample (by index),
    STEP_COLUMNS float64s: its trajectory's oldest version, tokens, prompt tokens, reward,
    whether it was cut at the length limit, interruptions. The ledger writes them where it
    has the values at hand (a completion recorded, a reward), so that the step record
    (`report.step_columns`) reads one buffer per group instead of every trajectory, whose
    objects are out of the CPU's caches by the time the group completes. Not used for a
    group with an agent episode's segments (`segmented`): a sample is then several
    trajectories."""
    num_ok: int = 0
    """Samples whose verdict is ok (counted by `Ledger.scored`)."""
    segmented: bool = False
    """A sample of it is an agent episode of several training segments."""
    episodes: bool = False
    """A sample of it is an episode (its trajectory carries the episode's counts)."""
    step_columns: StepColumns | None = None
    """A complete training group's part of its step record (`StepReport.completed`), kept
    from when its last reward came in."""

    @property
    def done(self) -> bool:
        return self.num_done == len(self.samples)

    def trajectories(self) -> list[Trajectory]:
        """Every training sequence of the group (an agent episode may have several); called on
        a done group, whose samples all hold their trajectory."""
        return [t for s in self.samples for t in s.trajectories()]


STEP_COLUMNS = 6
"""Values per trajectory in `Group.step_values` (report.StepColumns' columns)."""
_REWARD = 3
"""The reward's place among them."""


def trajectory_step_values(trajectory: Trajectory) -> tuple[float, ...]:
    """A trajectory's values in a step record (`Group.step_values`' columns, in order)."""
    return (
        trajectory.oldest_version(),
        trajectory.num_tokens,
        trajectory.num_prompt_tokens,
        trajectory.reward,
        trajectory.finish_reason == FinishReason.LENGTH.value,
        trajectory.timings.get("interruptions", 0),
    )


class RecordedMessage(NamedTuple):
    """What `Ledger.finish_completions` recorded of a Completions."""

    samples: list[Sample]
    """The samples recorded, in message order (stale completions left out)."""
    num_training: int
    """Of them, training samples (admission counts them)."""
    generated: list[Group]
    """Groups whose last sample to generate this recorded (their Score can go), without
    outcomes."""
    completed: list[Group]
    """With outcomes: groups whose last sample to score this recorded."""


class Ledger:
    """All requests and groups of a run, keyed by request id and group id."""

    def __init__(self) -> None:
        self.groups: dict[int, Group] = {}
        self.by_request: dict[str, Sample] = {}
        self.pending: collections.deque[Sample] = collections.deque()
        self.buffer: collections.deque[Group] = collections.deque()
        self.trained_group_ids: list[int] = []
        self.dropped_group_ids: list[int] = []
        self._next_group_id = 0

    # -- admission ------------------------------------------------------------------------------

    def add_group(
        self,
        prompt: Prompt,
        prompt_ids: np.ndarray,
        size: int,
        version: int,
        purpose: Purpose = Purpose.TRAIN,
        eval_round: int = -1,
        front: bool = False,
        position: int = -1,
    ) -> Group:
        """Admit a prompt group; its samples wait in `pending` (at the front if `front`)."""
        group = Group(
            group_id=self._next_group_id,
            purpose=purpose,
            prompt=prompt,
            prompt_ids=prompt_ids,
            admitted_version=version,
            eval_round=eval_round,
            position=position,
            step_values=array.array("d", bytes(8 * STEP_COLUMNS * size)),
        )
        self._next_group_id += 1
        group.samples = Sample.first_attempts(group.group_id, size)
        self.groups[group.group_id] = group
        for sample in group.samples:
            self.by_request[sample.request_id] = sample
        if front:
            self.pending.extendleft(reversed(group.samples))
        else:
            self.pending.extend(group.samples)
        return group

    def forget_pending(self, purpose: Purpose) -> None:
        """Samples of `purpose` waiting to be generated are never sent (training is over);
        they stay in their groups, which are never completed."""
        self.pending = collections.deque(
            s for s in self.pending if self.groups[s.group_id].purpose is not purpose
        )

    # -- generation -----------------------------------------------------------------------------

    def start_generation(self, sample: Sample, worker: bytes, now: float) -> None:
        assert sample.stage is Stage.PENDING, sample
        sample.stage, sample.worker, sample.submitted_at = Stage.GENERATING, worker, now

    def finish_generation(self, msg: Generated, worker: bytes) -> Sample | None:
        """Record a completion. None when the request is stale (re-queued or unknown)."""
        sample = self.by_request.get(msg.request_id)
        if sample is None or sample.stage is not Stage.GENERATING or sample.worker != worker:
            return None
        group = self.groups[sample.group_id]
        if msg.segment_prompt_lens:
            *sample.segments, sample.trajectory = _segments(msg, group)
        else:
            sample.trajectory = Trajectory.from_generation(
                prompt_id=group.prompt.prompt_id,
                group_id=group.group_id,
                prompt_ids=group.prompt_ids,
                output_ids=msg.output_ids,
                output_logprobs=msg.logprobs,
                output_versions=msg.versions,
                finish_reason=msg.finish_reason.value,
                output_loss_mask=msg.loss_mask,
            )
        sample.trajectory.timings.update(submitted=sample.submitted_at, generation=msg.generation_s)
        if msg.episode_end is not None:
            sample.trajectory.episode = {
                "turns": msg.num_turns,
                "tool_calls": msg.num_tool_calls,
                "tool_errors": msg.num_tool_errors,
                "tool_s": msg.tool_s,
                "end": msg.episode_end.value,
            }
            if msg.episode_end is EpisodeEnd.AGENT or msg.segment_prompt_lens:
                sample.trajectory.episode.update(
                    agent=True,
                    segments=max(1, len(msg.segment_prompt_lens)),
                    retries=msg.num_retries,
                    queue_s=msg.queue_s,
                    decode_s=msg.decode_s,
                    model_tokens=sum(t.num_model_tokens for t in sample.trajectories()),
                    observation_tokens=sum(
                        t.num_tokens - t.num_prompt_tokens - t.num_model_tokens
                        for t in sample.trajectories()
                    ),
                )
        sample.trajectory.timings["interruptions"] = float(msg.num_interruptions)
        if msg.episode_end is not None:
            group.episodes = True
        if msg.segment_prompt_lens:
            group.segmented = True
        else:  # its reward is written when it comes (`scored`)
            at = sample.index * STEP_COLUMNS
            group.step_values[at : at + STEP_COLUMNS] = array.array(
                "d", trajectory_step_values(sample.trajectory)
            )
        sample.stage, sample.worker = Stage.SCORING, None
        group.num_generated += 1
        return sample

    def finish_completions(
        self, msg: Completions, worker: bytes, with_outcomes: bool = False
    ) -> RecordedMessage:
        """Record the completions of `msg`, every one of which `checks.completions_fit`
        accepted (so each has at least one token and versions that never drop, its first
        run its oldest); a stale completion is left out. What the caller needs of the
        samples' groups is gathered in the same pass, while their memory is at hand
        (`RecordedMessage`). `with_outcomes`: `msg` carries its rollout worker's outcomes,
        every one a verdict with a finite reward (the caller checked), and each is recorded
        too (what `scored` does): the groups this completes are for `complete` once read.
        What `finish_generation` does for each, with the message's bookkeeping done once,
        except that no Trajectory is built here: each sample keeps where its completion
        lies in `msg` (`Sample.recorded`), and its trajectory is built when first read,
        which for a training sample is when its batch is packed, on the packing thread.
        At cluster scale the controller records tens of thousands of completions a step,
        and building their trajectories was most of this loop's time."""
        by_request, groups = self.by_request, self.groups
        oldest = msg.run_versions.tolist()  # a Python int per run: no numpy scalar per completion
        generating, scoring, cut = Stage.GENERATING, Stage.SCORING, FinishReason.LENGTH
        done, ok, rewards, verdicts = Stage.DONE, Verdict.OK, msg.rewards, msg.verdicts
        training = Purpose.TRAIN
        recorded, generated, completed, num_training = [], [], [], 0
        start = first = 0
        for i, (request_id, length, count, reason, interruptions) in enumerate(
            zip(
                msg.request_ids,
                msg.lengths,
                msg.num_runs,
                msg.finish_reasons,
                msg.num_interruptions,
                strict=True,
            )
        ):
            end, last = start + length, first + count
            sample = by_request.get(request_id)
            if sample is None or sample.stage is not generating or sample.worker != worker:
                start, first = end, last
                continue
            group = groups[sample.group_id]
            values = group.step_values
            sample.recorded = (
                msg,
                i,
                start,
                end,
                first,
                last,
                group.prompt,
                group.prompt_ids,
                values,
            )
            # `trajectory_step_values`, from the message's values at hand (reward: `scored`)
            num_prompt = len(group.prompt_ids)
            at = sample.index * STEP_COLUMNS
            values[at] = oldest[first]
            values[at + 1] = num_prompt + length
            values[at + 2] = num_prompt
            values[at + 4] = reason is cut
            values[at + 5] = interruptions
            sample.worker = None
            group.num_generated += 1
            recorded.append(sample)
            num_training += group.purpose is training
            start, first = end, last
            if not with_outcomes:
                sample.stage = scoring
                if group.num_generated == len(group.samples):
                    generated.append(group)
                continue
            # `scored`, for a recorded completion (no trajectory, no segments)
            sample.stage = done
            sample.verdict = verdict = verdicts[i]
            values[at + _REWARD] = rewards[i]
            group.num_ok += verdict is ok
            group.num_done += 1
            if group.num_done == len(group.samples):
                completed.append(group)
        return RecordedMessage(recorded, num_training, generated, completed)

    # -- scoring --------------------------------------------------------------------------------

    def start_scoring(self, sample: Sample, worker: bytes) -> None:
        assert sample.stage is Stage.SCORING, sample
        sample.worker = worker

    def scoring(self, request_id: str, worker: bytes | None) -> Sample | None:
        """The sample `worker` is scoring under `request_id`; None when an answer from it
        is stale (re-sent elsewhere, dropped, unknown). worker None: a sample whose reward
        worker was lost."""
        return self.held(request_id, worker, Stage.SCORING)

    def retry_scoring(self, sample: Sample) -> None:
        """A check ended without a verdict (an infrastructure failure): the sample stays in
        scoring, held by no worker, to be sent again."""
        assert sample.stage is Stage.SCORING, sample
        sample.worker = None

    def unscored(self, group: Group) -> list[Sample]:
        """`group`'s generated samples waiting to be sent for scoring, once none of its
        samples is still to be generated (empty before: a group is scored in one message)."""
        if group.num_generated < len(group.samples):
            return []
        return [s for s in group.samples if s.stage is Stage.SCORING and s.worker is None]

    def finish_scoring(
        self, request_id: str, outcome: RewardOutcome, worker: bytes | None
    ) -> Group | None:
        """Record a reward; returns the group when this completed it."""
        sample = self.scoring(request_id, worker)
        if sample is None:
            return None
        return self.scored(sample, outcome.reward, outcome.verdict)

    def scored(self, sample: Sample, reward: float, verdict: Verdict) -> Group | None:
        """`finish_scoring` of a sample being scored (`scoring` returned it)."""
        assert sample.is_generated, sample  # scored samples were generated
        if sample.trajectory is not None:  # else read from the step values when it is built
            sample.trajectory.reward = reward
        if sample.segments and verdict.is_error():  # a failed agent episode: no segment
            for segment in sample.segments:  # earns a reward
                segment.reward = 0.0
        sample.verdict = verdict
        sample.stage, sample.worker = Stage.DONE, None
        group = self.groups[sample.group_id]
        group.step_values[sample.index * STEP_COLUMNS + _REWARD] = reward
        group.num_ok += verdict is Verdict.OK
        group.num_done += 1
        if not group.done:
            return None
        self.complete(group)
        return group

    def complete(self, group: Group) -> None:
        """`group`, every sample of it scored, leaves the ledger's groups in flight: a
        training group for the buffer."""
        for s in group.samples:
            del self.by_request[s.request_id]
        if group.purpose is Purpose.TRAIN:
            self.buffer.append(group)
        del self.groups[group.group_id]

    # -- faults ---------------------------------------------------------------------------------

    def held(self, request_id: str, worker: bytes | None, stage: Stage) -> Sample | None:
        """The sample `worker` holds under `request_id` at `stage`, else None (stale, unknown)."""
        sample = self.by_request.get(request_id)
        if sample is None or sample.stage is not stage or sample.worker != worker:
            return None
        return sample

    def requeue(self, sample: Sample) -> None:
        """Generate `sample` again under a new attempt id (its worker's answer was dropped)."""
        assert sample.stage is Stage.GENERATING, sample  # never back from scoring
        del self.by_request[sample.request_id]
        sample.next_attempt()
        sample.stage, sample.worker = Stage.PENDING, None
        self.by_request[sample.request_id] = sample
        self.pending.appendleft(sample)

    def release_worker(self, worker: bytes) -> tuple[list[Sample], list[Sample]]:
        """A worker was lost: its generations go back to pending under a new attempt id;
        its scoring requests are returned for re-sending. Returns (requeued, rescore)."""
        requeued, rescore = [], []
        for sample in list(self.by_request.values()):
            if sample.worker != worker:
                continue
            if sample.stage is Stage.GENERATING:
                self.requeue(sample)
                requeued.append(sample)
            elif sample.stage is Stage.SCORING:
                sample.worker = None
                rescore.append(sample)
        return requeued, rescore

    # -- training -------------------------------------------------------------------------------

    def num_buffered(self) -> int:
        return sum(len(g.samples) for g in self.buffer)

    def take_batch(
        self, num_groups: int, priority: Callable[[Group], float] | None = None
    ) -> list[Group]:
        """`num_groups` complete training groups, each handed out once: the oldest in the
        buffer, or with `priority` those with the smallest value (ties: the oldest)."""
        if len(self.buffer) < num_groups:
            raise RuntimeError(f"buffer holds {len(self.buffer)} groups, {num_groups} requested")
        if priority is not None:
            order = sorted(range(len(self.buffer)), key=lambda i: (priority(self.buffer[i]), i))
            chosen = set(order[:num_groups])
            batch = [self.buffer[i] for i in order[:num_groups]]
            self.buffer = collections.deque(g for i, g in enumerate(self.buffer) if i not in chosen)
        else:
            batch = [self.buffer.popleft() for _ in range(num_groups)]
        self.trained_group_ids.extend(g.group_id for g in batch)
        return batch

    def drop_group(self, group: Group) -> Dropped:
        """Take a training group out of the run, wherever it is (pending, generating, scoring,
        or complete in the buffer); late answers for its requests are then stale."""
        if group.purpose is not Purpose.TRAIN:
            raise ValueError(
                f"group {group.group_id} is an evaluation group; only training groups are dropped"
            )
        buffered = any(g is group for g in self.buffer)
        if buffered:
            self.buffer = collections.deque(g for g in self.buffer if g is not group)
        elif self.groups.get(group.group_id) is not group:
            raise ValueError(
                f"group {group.group_id} is neither running nor buffered (trained "
                "or dropped already)"
            )
        generating: dict[bytes, list[str]] = {}
        unfinished = finished = tokens = 0
        for sample in group.samples:
            self.by_request.pop(sample.request_id, None)
            if sample.stage is Stage.GENERATING:
                assert sample.worker is not None  # set with the stage
                generating.setdefault(sample.worker, []).append(sample.request_id)
            if sample.stage in (Stage.PENDING, Stage.GENERATING):
                unfinished += 1
            else:
                finished += 1
                tokens += sample.num_output_tokens()
        if unfinished:
            self.pending = collections.deque(
                s for s in self.pending if s.group_id != group.group_id
            )
        self.groups.pop(group.group_id, None)
        self.dropped_group_ids.append(group.group_id)
        return Dropped(
            group=group,
            generating=generating,
            num_unfinished=unfinished,
            num_finished=finished,
            num_tokens=tokens,
        )

    def untrained_positions(self) -> list[int]:
        """Draw positions of the training groups admitted and not (yet) trained: those still
        generating or scoring, and those complete in the buffer."""
        running = [g.position for g in self.groups.values() if g.purpose is Purpose.TRAIN]
        return sorted(running + [g.position for g in self.buffer])

    def in_flight(self, purpose: Purpose | None = None) -> Iterable[Sample]:
        for sample in self.by_request.values():
            if purpose is None or self.groups[sample.group_id].purpose is purpose:
                yield sample


Recorded = tuple[Completions, int, int, int, int, int, Prompt, np.ndarray, array.array]
"""Where a recorded completion lies (`Sample.recorded`): its message, its place in the
message, its tokens' [start, end) and its version runs' [first, last) in the message's
arrays, and its group's prompt, prompt ids and step values (where its reward is written
when it comes). A tuple, built for every completion; it holds no Sample or Group, so that a
sample and its group form no reference cycle."""


def _recorded_trajectory(sample: Sample, recorded: Recorded) -> Trajectory:
    """The trajectory of a completion `Ledger.finish_completions` recorded for `sample`: what
    `finish_generation` builds from a Generated, with views of the message's arrays and its
    version runs (`Trajectory.from_checked`; arrays of other dtypes are converted), and the
    reward when it has one."""
    msg, i, start, end, first, last, prompt, prompt_ids, values = recorded
    versions = VersionRuns(msg.run_versions[first:last], msg.run_lengths[first:last])
    kept = (
        msg.output_ids.dtype is msg.run_versions.dtype is msg.run_lengths.dtype is _INT32
        and prompt_ids.dtype is _INT32
        and msg.logprobs.dtype is _FLOAT32
    )
    build: Callable[..., Trajectory] = (
        Trajectory.from_checked if kept else Trajectory.from_generation
    )
    trajectory = build(
        prompt_id=prompt.prompt_id,
        group_id=sample.group_id,
        prompt_ids=prompt_ids,
        output_ids=msg.output_ids[start:end],
        output_logprobs=msg.logprobs[start:end],
        output_versions=versions if kept else versions.expanded(),
        finish_reason=msg.finish_reasons[i].value,
        oldest_version=int(msg.run_versions[first]),
        timings={
            "submitted": sample.submitted_at,
            "generation": msg.generation_s[i],
            "interruptions": float(msg.num_interruptions[i]),
        },
    )
    trajectory.reward = values[sample.index * STEP_COLUMNS + _REWARD]  # 0.0 until scored
    return trajectory


def _segments(msg: Generated, group: Group) -> list[Trajectory]:
    """The training segments of an agent episode (Generated.segment_*), in order, each with
    its own prompt; every one but the last has its reward already (the last is scored)."""
    assert msg.prompt_ids is not None and msg.loss_mask is not None  # checks.generated_problem
    out, prompt_at, output_at = [], 0, 0
    lengths = zip(msg.segment_prompt_lens, msg.segment_output_lens, strict=True)
    for i, (num_prompt, num_output) in enumerate(lengths):
        span = slice(output_at, output_at + num_output)
        trajectory = Trajectory.from_generation(
            prompt_id=group.prompt.prompt_id,
            group_id=group.group_id,
            prompt_ids=msg.prompt_ids[prompt_at : prompt_at + num_prompt],
            output_ids=msg.output_ids[span],
            output_logprobs=msg.logprobs[span],
            output_versions=msg.versions[span],
            finish_reason=msg.finish_reason.value
            if i == len(msg.segment_prompt_lens) - 1
            else "stop",
            output_loss_mask=msg.loss_mask[span],
        )
        trajectory.reward = msg.segment_rewards[i]
        out.append(trajectory)
        prompt_at += num_prompt
        output_at += num_output
    return out
