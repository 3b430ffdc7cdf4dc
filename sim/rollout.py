"""A simulated rollout server: continuous batching under the KV-cache limit, on virtual time.

It speaks the rollout worker's protocol (workers/rollout/worker.py) and behaves as an
inference engine behind `InterruptibleGenerator` does, without simulating each token:

    Generate   -> each of its requests waits; it is admitted to the running batch when its KV cache
                  (prompt + tokens so far) fits, and prefilled (cost.prefill_s)
    running    -> the batch advances in chunks of decode steps, each chunk up to the next
                  event: a sequence finishing, the KV cache filling up (the newest sequence
                  is then preempted and recomputed later, as vLLM does), or a message
                  arriving. A chunk's duration is the sum of its steps' roofline times
                  (cost.decode_s, context growing by one token per sequence per step); a
                  chunk cut short by a message keeps the steps that fit in the time elapsed
    finish     -> its output (of the drawn length, its versions as runs), sent with the others
                  finished in one Completions once the batch has a free slot and nothing
                  waits for it; with reward.num_workers=0 checked first (the workload's
                  reward latency, reward.max_concurrency at once), its reward in the
                  Completions, the check holding its place as on a real rollout worker
    UpdateWeights(interrupt)     -> every started sequence is aborted (KV dropped), the
                  weights load (cost.weight_load_s), and the sequences are resubmitted
                  with prompt + tokens so far (re-prefilled); later tokens carry the new
                  version -> WeightsUpdated(pause_s, num_interrupted)
    UpdateWeights(no interrupt)  -> no new sequence starts; the started ones finish under
                  the old weights; then the weights load (sync mode, or interrupt=False)
    Cancel     -> the request is dropped without an answer

Completion lengths come from the workload (sim/workload.py); token ids and log-probs are
zeros (views of one read-only buffer), versions are real runs (one per weight version
that sampled part of the completion).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import typing
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from areal import clock
from areal.messages import (
    Cancel,
    Completions,
    FinishReason,
    Generate,
    UpdateWeights,
    Welcome,
    WeightsUpdated,
    WorkerKind,
)

from areal.tasks.base import Verdict

from areal.sim.workers import SimWorker
from areal.sim.workload import prompt_key, reward_key, sample_name

_ZEROS_I32 = np.zeros(1 << 20, dtype=np.int32)
_ZEROS_F32 = np.zeros(1 << 20, dtype=np.float32)
_ZEROS_I32.setflags(write=False)
_ZEROS_F32.setflags(write=False)


def _zeros(buffer: np.ndarray, n: int) -> np.ndarray:
    return buffer[:n] if n <= len(buffer) else np.zeros(n, dtype=buffer.dtype)


def _resolve(future: asyncio.Future, value: bool) -> None:
    if not future.done():
        future.set_result(value)


@dataclass(eq=False, kw_only=True)
class Seq:
    request_id: str
    prompt_len: int
    target: int
    """New tokens this completion runs for (it then stops, or hits max_new_tokens)."""
    stop: bool
    received_at: float
    key: int = 0
    """The prompt's key, the reward's draw (`Workload.correct`)."""
    done: int = 0
    """Tokens generated before the current stay in the running batch."""
    joined_step: int = 0
    """The server's step counter when it joined the running batch."""
    running: bool = False
    started: bool = False
    """Submitted to the engine under some version (a hold lets it finish under that one)."""
    version: int = 0
    """Version of the tokens generated from `seg_start` on."""
    seg_start: int = 0
    segments: list[tuple[int, int]] = field(default_factory=list)
    """(version, tokens) of the earlier versions' tokens."""
    interruptions: int = 0
    epoch: int = 0
    """Bumped when it leaves the running batch (stale entries of the finish heap)."""

    def context(self) -> int:
        return self.prompt_len + self.done


class _Finished(typing.NamedTuple):
    """A finished sequence, not yet sent: what its part of a Completions carries."""

    request_id: str
    length: int
    runs: list[tuple[int, int]]
    """(version, tokens) of each run of its tokens, in order, none empty."""
    finish_reason: FinishReason
    num_interruptions: int
    generation_s: float
    correct: bool | None = None
    """Checked here (reward.num_workers=0): whether it was judged right; None: unchecked."""


class SimRollout(SimWorker):
    kind = WorkerKind.ROLLOUT

    def setup(self, welcome: Welcome) -> int:
        env = self.env
        self.tp = env.rollout_tp
        self.capacity = env.cost.kv_capacity_tokens(self.tp)
        self.max_running = env.cfg.rollout.max_concurrent
        """Sequences decoded at once, as a real engine's (vLLM's max_num_seqs): the
        controller keeps up to rollout.max_queued more here, which wait."""
        self.max_new_tokens = env.cfg.rollout.max_new_tokens
        self.version = welcome.version
        self.step = 0
        self.running: dict[str, Seq] = {}
        self.waiting: list[Seq] = []  # admission order; preempted ones go back to the front
        self.by_id: dict[str, Seq] = {}
        self._answered: dict[str, _Finished] = {}
        """Finished, not yet sent (`_answer`)."""
        self._scores = env.cfg.reward.num_workers == 0
        self._checks = asyncio.Semaphore(env.cfg.reward.max_concurrency)
        self._checking: dict[str, asyncio.Task] = {}
        """Finished and being checked (reward.num_workers=0), by request id."""
        self._finish_heap: list[tuple[int, int, int, Seq]] = []
        self._order = itertools.count()
        self._ctx_base = 0  # sum over running of (context at join - joined_step)
        self._updates: list[UpdateWeights] = []
        self._hold = False
        self._waker: asyncio.Future | None = None
        self._busy_host = False
        env.host.listen(self._wake)
        self.spawn(self._engine())
        return self.version

    # -- messages -------------------------------------------------------------------------------

    def handle(self, msg: Any) -> None:
        if isinstance(msg, Generate):
            self._on_generate(msg)
        elif isinstance(msg, Cancel):
            for request_id in msg.request_ids:
                self._drop(request_id)
        elif isinstance(msg, UpdateWeights):
            self._updates.append(msg)
            self._hold = True  # Generates handled after this must wait for the new weights
        else:
            super().handle(msg)
            return
        self._wake()

    def _on_generate(self, msg: Generate) -> None:
        key = prompt_key(msg.prompt_ids)
        for request_id, _ in msg.samples():
            target = self.env.workload.completion_tokens(
                key, sample_name(request_id), msg.max_new_tokens
            )
            seq = Seq(
                request_id=request_id,
                prompt_len=len(msg.prompt_ids),
                target=target,
                stop=target < msg.max_new_tokens,
                received_at=clock.now(),
                key=reward_key(msg.reference),
            )
            self.by_id[request_id] = seq
            self.waiting.append(seq)

    def _drop(self, request_id: str) -> None:
        checking = self._checking.pop(request_id, None)
        if checking is not None:
            checking.cancel()
        seq = self.by_id.pop(request_id, None)
        if seq is None:
            return
        if seq.running:
            self._leave(seq)
        else:
            self.waiting.remove(seq)
        self._answered.pop(request_id, None)

    def _answer(self) -> Completions | None:
        """The finished completions, all in one message, once the engine has a free slot and
        nothing queued for it (the rollout worker's rule: workers/rollout/worker.py,
        `Answered`); None while it is full or nothing has finished. Built here rather than
        by `Completions.of`, which would copy the simulated zero tokens: these are views."""
        if not self._answered or len(self.by_id) + len(self._checking) >= self.max_running:
            return None
        results = list(self._answered.values())
        self._answered.clear()
        lengths = [r.length for r in results]
        runs = [run for r in results for run in r.runs]
        outcomes: dict[str, Any] = {}
        if self._scores:
            outcomes = {
                "rewards": [1.0 if r.correct else 0.0 for r in results],
                "verdicts": [Verdict.OK if r.correct else Verdict.WRONG for r in results],
                "details": [""] * len(results),
                "check_retries": [0] * len(results),
            }
        return Completions(
            request_ids=[r.request_id for r in results],
            lengths=lengths,
            output_ids=_zeros(_ZEROS_I32, sum(lengths)),
            logprobs=_zeros(_ZEROS_F32, sum(lengths)),
            num_runs=[len(r.runs) for r in results],
            run_versions=np.array([v for v, _ in runs], np.int32),
            run_lengths=np.array([n for _, n in runs], np.int32),
            finish_reasons=[r.finish_reason for r in results],
            num_interruptions=[r.num_interruptions for r in results],
            generation_s=[r.generation_s for r in results],
            **outcomes,
        )

    def _finished(self, seq: Seq) -> None:
        """`seq` finished: it waits to be answered, checked first under reward.num_workers=0."""
        if self._scores:
            self._checking[seq.request_id] = self.spawn(self._check(seq, self._result(seq)))
        else:
            self._answered[seq.request_id] = self._result(seq)

    async def _check(self, seq: Seq, result: _Finished) -> None:
        async with self._checks:
            await asyncio.sleep(self.env.workload.reward_latency_s)
        del self._checking[seq.request_id]
        correct = self.env.workload.correct(seq.key, sample_name(seq.request_id))
        self._answered[seq.request_id] = result._replace(correct=correct)
        self._wake()

    def _wake(self) -> None:
        if self._waker is not None:
            _resolve(self._waker, True)

    async def _sleep(self, seconds: float) -> tuple[float, bool]:
        """Sleep `seconds` unless woken first; (seconds elapsed, woken)."""
        loop = asyncio.get_running_loop()
        waker = self._waker = loop.create_future()
        timer = loop.call_later(seconds, _resolve, waker, False) if seconds < float("inf") else None
        start = loop.time()
        try:
            woken = await waker
        finally:
            if timer is not None:
                timer.cancel()
            self._waker = None
        return loop.time() - start, woken

    # -- the engine -----------------------------------------------------------------------------

    async def _engine(self) -> None:
        while True:
            answer = self._answer()  # after each chunk, and when a cancel emptied the batch
            if answer is not None:
                await self.channel.send(answer)
            if self._updates and await self._update_weights():
                continue
            admitted = self._admit()
            if admitted:
                self._set_busy(True)
                await self._compute(
                    self.env.cost.prefill_s([s.context() for s in admitted], self.tp)
                )
                continue
            if not self.running:
                self._set_busy(False)
                await self._sleep(float("inf"))
                continue
            self._set_busy(True)
            await self._decode_chunk()

    def _set_busy(self, busy: bool) -> None:
        if busy != self._busy_host:
            self._busy_host = busy
            self.env.host.set_busy(WorkerKind.ROLLOUT, busy, self.tp)

    async def _compute(self, seconds: float) -> None:
        """Work that runs to completion (prefill, loading weights); messages wait."""
        await self._sleep_through(seconds * self.env.host.slowdown(WorkerKind.ROLLOUT))

    async def _sleep_through(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while loop.time() < end:
            await self._sleep(end - loop.time())

    def _admit(self) -> list[Seq]:
        """Waiting sequences that fit in the KV cache and under max_running join the batch (in
        order)."""
        admitted = []
        context = self._context()
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if self._hold and not seq.started:
                break  # a weight update is pending: new sequences start under it
            if context + seq.context() + len(self.running) + 1 > self.capacity and self.running:
                break
            self.waiting.pop(0)
            if not seq.started:
                seq.started, seq.version, seq.seg_start = True, self.version, seq.done
            self._join(seq)
            context += seq.context()
            admitted.append(seq)
        return admitted

    async def _decode_chunk(self) -> None:
        cost, batch = self.env.cost, len(self.running)
        context = self._context()
        next_finish = self._next_finish() - self.step
        room = (self.capacity - context) // batch
        if room <= 0 and batch == 1:
            raise RuntimeError(
                f"{self.worker_id}: one sequence of {context} tokens fills the KV cache of "
                f"{self.capacity} tokens; raise rollout_tp or lower max_new_tokens"
            )
        if room <= 0:
            self._preempt_newest()
            return
        steps = min(next_finish, room)
        slowdown = self.env.host.slowdown(WorkerKind.ROLLOUT)
        seconds = cost.decode_s(batch, context, steps, self.tp) * slowdown
        elapsed, woken = await self._sleep(seconds)
        if woken:
            steps = cost.decode_steps_within(batch, context, elapsed / slowdown, self.tp, steps)
        self.step += steps
        self.env.generated_tokens[0] += steps * batch
        for seq in self._pop_finished():
            self._finished(seq)

    # -- the running batch ------------------------------------------------------------------------

    def _context(self) -> int:
        return self._ctx_base + len(self.running) * self.step

    def _join(self, seq: Seq) -> None:
        seq.running, seq.joined_step = True, self.step
        self.running[seq.request_id] = seq
        self._ctx_base += seq.context() - self.step
        finish = self.step + seq.target - seq.done
        heapq.heappush(self._finish_heap, (finish, next(self._order), seq.epoch, seq))

    def _leave(self, seq: Seq) -> None:
        """Out of the running batch, keeping the tokens generated so far."""
        self._ctx_base -= seq.context() - seq.joined_step
        seq.done += self.step - seq.joined_step
        seq.running = False
        seq.epoch += 1
        del self.running[seq.request_id]

    def _next_finish(self) -> int:
        heap = self._finish_heap
        while heap[0][3].epoch != heap[0][2]:
            heapq.heappop(heap)
        return heap[0][0]

    def _pop_finished(self) -> list[Seq]:
        finished, heap = [], self._finish_heap
        while heap and (heap[0][3].epoch != heap[0][2] or heap[0][0] <= self.step):
            _, _, epoch, seq = heapq.heappop(heap)
            if seq.epoch == epoch:
                self._leave(seq)
                del self.by_id[seq.request_id]
                finished.append(seq)
        return finished

    def _preempt_newest(self) -> None:
        """The KV cache is full: the newest sequence gives its cache back and waits."""
        newest = max(self.running.values(), key=lambda s: s.joined_step)
        self._leave(newest)
        self.waiting.insert(0, newest)

    def _result(self, seq: Seq) -> _Finished:
        runs = [(v, n) for v, n in (*seq.segments, (seq.version, seq.done - seq.seg_start)) if n]
        return _Finished(
            request_id=seq.request_id,
            length=seq.done,
            runs=runs,
            finish_reason=FinishReason.STOP if seq.stop else FinishReason.LENGTH,
            num_interruptions=seq.interruptions,
            generation_s=clock.now() - seq.received_at,
        )

    # -- weight updates ---------------------------------------------------------------------------

    async def _update_weights(self) -> bool:
        """Apply the newest pending update when its protocol allows; True if applied."""
        update = self._updates[-1]  # disk mode: each is a full version; skip to the newest
        started = [s for s in self.by_id.values() if s.started]
        if not update.interrupt and started:
            return False  # drain first: started sequences finish under the old weights
        loop = asyncio.get_running_loop()
        start = loop.time()
        interrupted = 0
        for seq in started:
            if seq.running:
                self._leave(seq)
                self.waiting.append(seq)
            seq.interruptions += 1
            interrupted += 1
        self.env.interrupted[0] += interrupted
        self.waiting.sort(key=lambda s: not s.started)  # resubmitted first, in order
        self._set_busy(False)
        load = 0.0 if self.env.colocated else self.env.cost.weight_load_s(self.tp)
        await self._compute(load)
        self.version = update.version
        for seq in started:
            if seq.done > seq.seg_start:
                seq.segments.append((seq.version, seq.done - seq.seg_start))
            seq.version, seq.seg_start = update.version, seq.done
        self._updates.clear()
        self._hold = False
        await self.channel.send(
            WeightsUpdated(
                version=update.version, pause_s=loop.time() - start, num_interrupted=interrupted
            )
        )
        return True
