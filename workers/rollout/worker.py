"""The rollout worker: serves Generate requests with an engine, swaps weights on command.

    Generate  -> InterruptibleGenerator.generate (a task per request id) -> its single
                 completion waits while the engine has others queued (Answered), then goes
                 with every completion waiting in one Completions
    UpdateWeights(disk)        -> update from <path>
    UpdateWeights(stream) + WeightsChunk x n -> update from the received tensors
    JoinGroup(weights)         -> join that generation of the weights group (collective mode)
    UpdateWeights(collective)  -> receive the broadcast buckets, update from them
    UpdateWeights(shm)         -> update from the shared-memory slot <path>, read in place
    Cancel    -> the request's task is cancelled (or its waiting completion forgotten); no
                 result is sent
    reward.num_workers=0 -> each single completion is checked here, by the task's reward
                 function (workers/reward/checker.py, infrastructure failures retried up
                 to reward.retries times), before it waits in Answered: its Completions
                 carries the rewards, and the controller sends no Score. The check holds
                 the request's place on this worker until it ends.
    Generate with episode.environment set -> EpisodeRunner.run (episode.py): model turns
                 and the environment's observations in one trajectory -> Generated with
                 its loss mask and the environment's reward
    Generate with agent.function set -> AgentRunner.run (agent/runner.py): the user's agent
                 against this worker's OpenAI-compatible endpoint, every chat call a
                 sequence on this worker's generator -> Generated with the episode's
                 segments and rewards

Updates are applied one at a time, in version order. In async mode they interrupt
in-flight sequences, which continue under the new weights (tokens keep the version that
sampled them); otherwise in-flight sequences finish first. Requests that arrive while an
update is pending wait for it, so their tokens carry the new version. A load that fails (a
version directory gone, a corrupt file) leaves the previous weights in service and is
reported (WeightsUpdated.error); the controller sends the newest version again. In collective mode a
version may be broadcast again (the group was re-formed for a new member, or a broadcast
failed): the worker takes part, and drops what it already serves; a failed receive is
reported as GroupStatus(FAILED) and requests keep waiting for the version.

With LoRA (trainer.lora.rank > 0) every update, in every mode, is the version's adapter
alone; `sources.py` turns what arrived into the engine's weight source.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING, Any, cast

import torch

from areal.messages import (
    Cancel,
    Completions,
    Generate,
    Generated,
    GroupName,
    GroupState,
    GroupStatus,
    JoinGroup,
    UpdateWeights,
    Welcome,
    WeightsChunk,
    WeightsUpdated,
    WorkerKind,
)
from areal.models.weight_slots import SlotError
from areal.workers.base import Worker
from areal.workers.collective import WeightsMember, report_weights_op
from areal.workers.rollout.engine import SamplingParams, WeightSource
from areal.workers.rollout.episode import generated_episode, start_episodes
from areal.workers.rollout.factory import make_engine
from areal.workers.rollout.interruptible import InterruptibleGenerator
from areal.workers.rollout.sources import PendingSlot, path_source, tensor_source

if TYPE_CHECKING:
    from areal.workers.reward.checker import CompletionChecker
    from areal.workers.rollout.agent.runner import AgentRunner

log = logging.getLogger(__name__)


class RolloutWorker(Worker):
    kind = WorkerKind.ROLLOUT

    async def setup(self, welcome: Welcome) -> int:
        cfg = self.config
        torch.set_num_threads(cfg.rollout.threads)
        self.engine = await make_engine(cfg, self.rank)
        # The engine starts from the model directory: version 0. A worker joining later
        # catches up from the latest weights (disk, shm: now; stream: the controller re-sends
        # them), and from any version published while it set up once it is ready.
        self.generator = InterruptibleGenerator(self.engine, version=0)
        if welcome.weights_path and welcome.version > 0:
            await self._load_welcome_weights(welcome)
        self._requests: dict[str, asyncio.Task] = {}
        self._answered = Answered()
        self._updates: asyncio.Queue = asyncio.Queue()
        self._stream: tuple[UpdateWeights, list[WeightsChunk]] | None = None
        self._weights_member: WeightsMember | None = None
        self._collective_hold = False
        self._announced = 0
        """The newest version an UpdateWeights(collective) announced."""
        self.episodes = await start_episodes(cfg, self.generator)
        self.checker: CompletionChecker | None = None
        if cfg.reward.num_workers == 0 and self.episodes is None and cfg.agent.function is None:
            from areal.workers.reward.checker import CompletionChecker

            self.checker = await CompletionChecker.start(cfg)
        self.agents: AgentRunner | None = None
        if cfg.agent.function is not None:
            # Imported here: the OpenAI client and the endpoint's server cost every rollout
            # worker (and the fork server, controller/preload.py) most of a second of
            # imports, which a run without agents does not need.
            from areal.workers.rollout.agent.runner import start_agents

            self.agents = await start_agents(
                cfg,
                self.generator,
                rank=self.rank,
                context_len=getattr(self.engine, "max_seq_len", None),
            )
        self.spawn(self._update_loop(), "weight-updates")
        # What it serves now (stream/collective: the current version arrives after Ready).
        return self.generator.version

    async def _load_welcome_weights(self, welcome: Welcome) -> None:
        """Serve the version the Welcome names, unless it is gone by now: the trainer keeps
        weight_sync.keep_versions versions and prunes (disk) or overwrites (shm) older ones,
        which a worker that sets up for seconds while steps take less can find. It then
        stays at version 0 and says so in its Ready; the controller sends it the newest
        version before its first Generate (controller/weight_sync.py, `on_ready`)."""
        assert welcome.weights_path is not None
        try:
            source = path_source(self.config, welcome.weights_path, welcome.version)
            if isinstance(source, PendingSlot):
                source = await asyncio.to_thread(source.read)
            await self.generator.update_weights(source, welcome.version)
        except (SlotError, FileNotFoundError) as err:
            log.warning(
                "weights version %d named by the Welcome are gone (%s); ready at version %d "
                "until the controller sends the newest",
                welcome.version,
                err,
                self.generator.version,
            )

    async def handle(self, msg: Any) -> None:
        if isinstance(msg, Generate):
            for request_id, seed in msg.samples():
                task = self.spawn(self._generate(msg, request_id, seed), request_id)
                self._requests[request_id] = task
                task.add_done_callback(functools.partial(self._settled, request_id))
        elif isinstance(msg, Cancel):
            for request_id in msg.request_ids:
                running = self._requests.pop(request_id, None)
                if running is not None:
                    running.cancel()
            self._answered.forget(msg.request_ids)
        elif isinstance(msg, UpdateWeights):
            self._on_update(msg)
        elif isinstance(msg, WeightsChunk):
            self._on_chunk(msg)
        elif isinstance(msg, JoinGroup) and msg.group is GroupName.WEIGHTS:
            self._on_join(msg)
        else:
            log.warning("rollout worker ignores %s", type(msg).__name__)

    def _on_update(self, msg: UpdateWeights) -> None:
        if msg.mode == "collective":
            self._on_collective_update(msg)
            return
        if msg.mode in ("disk", "shm") and not msg.path:  # refused before anything waits on it
            raise ValueError(f"{msg.mode} update to version {msg.version} names no path")
        # Block new requests *now*, before any later Generate is handled: their tokens must
        # carry the new version.
        self.generator.hold_new_requests()
        if msg.mode in ("disk", "shm"):
            assert msg.path  # checked above
            self._updates.put_nowait((msg, path_source(self.config, msg.path, msg.version)))
        elif msg.mode == "stream":
            self._stream = (msg, [])
            if msg.num_chunks == 0:
                raise ValueError(f"stream update to version {msg.version} with no chunks")
        else:
            raise ValueError(f"weight_sync.mode={msg.mode!r} is not supported by this worker")

    def _on_chunk(self, msg: WeightsChunk) -> None:
        if self._stream is None or self._stream[0].version != msg.version:
            log.warning(
                "dropping a weight chunk of version %d: no stream update pending", msg.version
            )
            return
        update, chunks = self._stream
        chunks.append(msg)
        if len(chunks) == update.num_chunks:
            tensors = {  # the codec rebuilt each as a torch tensor (messages.Tensor)
                name: cast(torch.Tensor, tensor)
                for chunk in chunks
                for name, tensor in zip(chunk.names, chunk.tensors, strict=True)
            }
            self._stream = None
            self._updates.put_nowait((update, tensor_source(self.config, tensors, update.version)))

    def _weights(self) -> WeightsMember:
        if self._weights_member is None:
            self._weights_member = WeightsMember()
        return self._weights_member

    def _on_join(self, msg: JoinGroup) -> None:
        joined = self._weights().join(msg, msg.store)
        self.spawn(
            report_weights_op(self.send, msg.generation, joined, "join"),
            f"join-weights-{msg.generation}",
        )

    def _on_collective_update(self, msg: UpdateWeights) -> None:
        member = self._weights()
        received = member.thread.submit(lambda: member.group.receive(msg.manifest, msg.generation))
        # One hold at a time: it is released by the next update actually applied, or when
        # no announced version is left to apply (`_drop_collective_update`).
        self._announced = max(self._announced, msg.version)
        if msg.version > self.generator.version and not self._collective_hold:
            self.generator.hold_new_requests()
            self._collective_hold = True
        self._updates.put_nowait((msg, received))

    def _drop_collective_update(self) -> None:
        """An update is not applied (failed or already served). The hold stays while a newer
        announced version is still to come (its update releases it); else it is released.
        A version sent again while its first copy loads takes a hold the first copy does not
        release: kept, every later Generate would wait forever (no new version comes while
        no rollout worker generates)."""
        if self._collective_hold and self._announced <= self.generator.version:
            self._collective_hold = False
            self.generator.release_hold()

    async def _collective_source(
        self, update: UpdateWeights, received: asyncio.Future
    ) -> WeightSource | None:
        """The received weights, or None: failed (reported) or already served."""
        try:
            tensors = await received
        except Exception as err:  # fault boundary: the controller re-forms and re-sends
            log.error("weights broadcast of version %d failed: %r", update.version, err)
            await self.send(
                GroupStatus(
                    group=GroupName.WEIGHTS,
                    generation=update.generation,
                    state=GroupState.FAILED,
                    error=repr(err),
                )
            )
            self._drop_collective_update()
            return None
        if update.version <= self.generator.version:
            self._drop_collective_update()
            return None
        self._collective_hold = False  # the update about to run releases it
        return tensor_source(self.config, tensors, update.version)

    async def _update_loop(self) -> None:
        while True:
            update, source = await self._updates.get()
            if update.mode in ("disk", "shm"):
                update, source = self._newest_path_update(update, source)
            if isinstance(source, asyncio.Future):
                source = await self._collective_source(update, source)
                if source is None:
                    continue
            elif update.version <= self.generator.version:  # sent again after it loaded
                self.generator.release_hold()
                continue
            start = time.monotonic()
            try:
                if isinstance(source, PendingSlot):  # shm + LoRA: copied out under its lock
                    source = await asyncio.to_thread(source.read)
                num_interrupted = await self.generator.update_weights(
                    source, update.version, interrupt=update.interrupt
                )
            except Exception as err:  # fault boundary: report; the controller sends it again
                if isinstance(source, PendingSlot):  # never reached update_weights
                    self.generator.release_hold()
                log.error(
                    "loading weights version %d failed: %r; serving version %d until "
                    "the controller sends weights again",
                    update.version,
                    err,
                    self.generator.version,
                )
                await self.send(
                    WeightsUpdated(version=update.version, error=f"{type(err).__name__}: {err}")
                )
                continue
            await self.send(
                WeightsUpdated(
                    version=update.version,
                    pause_s=time.monotonic() - start,
                    num_interrupted=num_interrupted,
                )
            )

    def _newest_path_update(
        self, update: UpdateWeights, source: WeightSource
    ) -> tuple[UpdateWeights, WeightSource]:
        """Skip to the newest queued disk or shm update: each is a full weight set (or the
        whole adapter), and the trainer prunes old version directories / overwrites old
        slots (weight_sync.keep_versions), so a worker that fell behind must not try to
        load one that may be gone. A run has one weight_sync.mode: every queued update is
        of the same mode."""
        while not self._updates.empty():
            log.info("weights version %d superseded before loading", update.version)
            self.generator.release_hold()
            update, source = self._updates.get_nowait()
        return update, source

    def _settled(self, request_id: str, task: asyncio.Task) -> None:
        """A request is done, failed (reported by `spawn`) or cancelled: a single completion
        waits in `_answered` while the engine has others queued for the slot it freed."""
        self._requests.pop(request_id, None)
        if not task.cancelled() and task.exception() is None and task.result() is not None:
            self._answered.add(task.result())
        if len(self._requests) < self.config.rollout.max_concurrent:
            answer = self._answered.take()
            if answer is not None:
                self.spawn(self.send(answer))

    async def _generate(self, msg: Generate, request_id: str, seed: int | None) -> Generated | None:
        """One completion of `msg`'s prompt: an episode's or an agent's is sent at once (as a
        Generated); a single completion is returned, to be answered by `_settled`."""
        start = time.monotonic()
        params = SamplingParams(
            max_new_tokens=msg.max_new_tokens,
            temperature=msg.temperature,
            top_p=msg.top_p,
            stop_token_ids=list(msg.stop_token_ids),
            seed=seed,
        )
        if self.agents is not None:
            from areal.workers.rollout.agent.runner import generated_agent_episode

            agent_episode = await self.agents.run(
                request_id,
                params,
                prompt_id=msg.prompt_id,
                prompt_text=msg.prompt_text,
                reference=msg.reference,
            )
            await self.send(generated_agent_episode(request_id, agent_episode, msg.prompt_ids))
            return None
        if self.episodes is not None:
            episode = await self.episodes.run(
                request_id,
                msg.prompt_ids.tolist(),
                params,
                prompt_id=msg.prompt_id,
                reference=msg.reference,
            )
            await self.send(generated_episode(request_id, episode, time.monotonic() - start))
            return None
        result = await self.generator.generate(request_id, msg.prompt_ids.tolist(), params)
        completion = Generated(
            request_id=request_id,
            output_ids=result.token_ids_array(),
            logprobs=result.logprobs_array(),
            versions=result.versions_array(),
            finish_reason=result.finish_reason,
            num_interruptions=result.num_interruptions,
            generation_s=time.monotonic() - start,
        )
        if self.checker is not None:  # reward.num_workers=0: scored here
            outcome, retries = await self.checker.check_retrying(
                completion.output_ids, msg.reference, self.config.reward.retries
            )
            completion.reward = float(outcome.reward)
            completion.verdict = outcome.verdict
            completion.detail = outcome.detail[:2000]
            completion.check_retries = retries
        return completion

    async def close(self) -> None:
        agents, episodes = getattr(self, "agents", None), getattr(self, "episodes", None)
        checker = getattr(self, "checker", None)
        if checker is not None:
            checker.close()
        if agents is not None:
            await agents.close()
        if episodes is not None:
            await episodes.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            await engine.close()


class Answered:
    """Single completions finished and not yet sent, answered together (`take`) when the
    worker's engine has a free slot and nothing queued for it (fewer requests than
    rollout.max_concurrent), which is when it wants more work. While its engine is full
    (the controller keeps up to rollout.max_queued requests beyond max_concurrent on it, and
    the engine queues them), finished completions gather: about max_queued + 1 go in one
    Completions, and the controller, whose cost is per message, answers with as many
    samples, mostly in one Generate.
    With fewer requests than max_concurrent, each is answered as it finishes."""

    def __init__(self) -> None:
        self._waiting: dict[str, Generated] = {}

    def add(self, completion: Generated) -> None:
        self._waiting[completion.request_id] = completion

    def forget(self, request_ids: list[str]) -> None:
        """Cancelled: their results are not wanted."""
        for request_id in request_ids:
            self._waiting.pop(request_id, None)

    def take(self) -> Completions | None:
        """Everything waiting, in one message (None: nothing)."""
        if not self._waiting:
            return None
        completions = list(self._waiting.values())
        self._waiting.clear()
        return Completions.of(completions)
