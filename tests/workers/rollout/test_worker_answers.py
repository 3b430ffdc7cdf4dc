"""How a rollout worker answers over the real torch engine: finished single completions wait
while its engine has other requests queued (at least rollout.max_concurrent unsettled) and go
together in one Completions when it has a free slot; below max_concurrent each goes as it
finishes; a cancelled request is left out; a failed one is reported on its own."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from rollout_helpers import random_prompts

from areal.config import load_config
from areal.messages import Cancel, Completions, FinishReason, Generate, Generated, WorkerError
from areal.models.tokenizer import load_tokenizer
from areal.sandbox.pool import CheckerPool
from areal.tasks.base import RewardOutcome, Verdict
from areal.workers.reward.checker import CompletionChecker
from areal.workers.rollout.interruptible import InterruptibleGenerator
from areal.workers.rollout.worker import Answered, RolloutWorker


def answering_worker(
    engine, max_concurrent: int = 128, checker: CompletionChecker | None = None, *overrides: str
) -> tuple[RolloutWorker, list]:
    """A rollout worker's request path (what `setup` builds for it), without a controller;
    the messages it sends are collected. `checker`: it scores its own completions (what
    `setup` starts under reward.num_workers=0)."""
    worker = RolloutWorker("tcp://127.0.0.1:1", "rollout-test", secret="")
    worker.config = load_config(overrides=[f"rollout.max_concurrent={max_concurrent}", *overrides])
    worker.generator = InterruptibleGenerator(engine, version=0)
    worker._requests = {}
    worker._answered = Answered()
    worker.episodes = worker.agents = None
    worker.checker = checker
    sent: list = []

    async def send(msg) -> None:
        sent.append(msg)

    worker.send = send
    return worker, sent


def generate(request_ids: list[str], max_new_tokens: int = 6, reference: object = None) -> Generate:
    return Generate(
        request_ids=request_ids,
        prompt_ids=np.array(random_prompts(1, min_len=6, max_len=6, seed=2)[0], np.int32),
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        seeds=[100 + i for i in range(len(request_ids))],
        reference=reference,
    )


async def settle(worker: RolloutWorker) -> None:
    while worker._tasks:
        await asyncio.gather(*list(worker._tasks), return_exceptions=True)


async def test_completions_wait_while_others_are_queued_and_then_go_together(make_engine):
    # max_concurrent 2, four requests: the first two to finish wait (two or more others
    # unsettled: the engine stays full), the third goes with them, the last alone.
    worker, sent = answering_worker(await make_engine(), max_concurrent=2)
    await worker.handle(generate(["g0-s0-a0", "g0-s1-a0", "g0-s2-a0", "g0-s3-a0"]))
    await settle(worker)
    assert [type(m) for m in sent] == [Completions, Completions]
    assert [len(m.request_ids) for m in sent] == [3, 1]
    assert sorted(r for m in sent for r in m.request_ids) == [f"g0-s{i}-a0" for i in range(4)]
    for completion in sent[0].completions():
        assert 0 < len(completion.output_ids) <= 6
        assert (completion.versions == 0).all() and (completion.logprobs <= 0).all()
    assert not worker._requests


async def test_below_max_concurrent_each_completion_goes_as_it_finishes(make_engine):
    worker, sent = answering_worker(await make_engine())
    await worker.handle(generate(["g0-s0-a0", "g0-s1-a0", "g0-s2-a0"]))
    await settle(worker)
    assert [len(m.request_ids) for m in sent] == [1, 1, 1]


async def test_a_cancelled_request_is_left_out_and_a_generate_all_cancelled_is_not_answered(
    make_engine,
):
    worker, sent = answering_worker(await make_engine())
    await worker.handle(generate(["g1-s0-a0", "g1-s1-a0"], max_new_tokens=200))
    await worker.handle(Cancel(request_ids=["g1-s1-a0"]))
    await worker.handle(generate(["g2-s0-a0"], max_new_tokens=200))
    await worker.handle(Cancel(request_ids=["g2-s0-a0"]))
    await settle(worker)
    (answer,) = sent
    assert answer.request_ids == ["g1-s0-a0"]


async def test_a_failed_request_is_reported_alone_and_the_others_still_answered(
    make_engine, monkeypatch
):
    worker, sent = answering_worker(await make_engine(), max_concurrent=2)
    real = worker.generator.generate

    async def failing(request_id, prompt, params):
        if request_id == "g3-s1-a0":
            raise RuntimeError("engine refused it")
        return await real(request_id, prompt, params)

    monkeypatch.setattr(worker.generator, "generate", failing)
    await worker.handle(generate(["g3-s0-a0", "g3-s1-a0", "g3-s2-a0"]))
    await settle(worker)
    errors = [m for m in sent if isinstance(m, WorkerError)]
    answers = [m for m in sent if isinstance(m, Completions)]
    assert [(e.request_id, e.error) for e in errors] == [
        ("g3-s1-a0", "RuntimeError: engine refused it")
    ]
    assert sorted(r for m in answers for r in m.request_ids) == ["g3-s0-a0", "g3-s2-a0"]


async def test_a_generate_that_names_no_distinct_samples_is_refused(make_engine):
    worker, _ = answering_worker(await make_engine())
    with pytest.raises(ValueError, match="distinct request ids"):
        await worker.handle(generate(["a", "a"]))


def test_a_cancelled_completion_waiting_to_be_answered_is_forgotten():
    answered = Answered()
    assert answered.take() is None
    for request_id in ["a", "b", "c"]:
        answered.add(
            Generated(
                request_id=request_id,
                output_ids=np.arange(2, dtype=np.int32),
                logprobs=np.zeros(2, np.float32),
                versions=np.zeros(2, np.int32),
                finish_reason=FinishReason.STOP,
            )
        )
    answered.forget(["b", "x"])
    answer = answered.take()
    assert answer is not None and answer.request_ids == ["a", "c"] and answer.lengths == [2, 2]
    assert answered.take() is None


class _CountingTask:
    """A task whose reward function answers from a script: what it was asked (the decoded
    completion and the reference) is kept; the first `failures` calls raise, as a broken
    verifier does (the checker pool makes each an ERROR outcome)."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.calls: list[tuple[str, object]] = []

    def reward(self, completion: str, reference: object) -> RewardOutcome:
        self.calls.append((completion, reference))
        if len(self.calls) <= self.failures:
            raise RuntimeError("the verifier crashed")
        return RewardOutcome(reward=1.0, verdict=Verdict.OK, detail=f"{len(completion)} chars")


def _checker(tiny_model_dir: str, task: _CountingTask) -> CompletionChecker:
    return CompletionChecker(task, load_tokenizer(tiny_model_dir), CheckerPool(max_concurrency=2))


async def test_with_no_reward_workers_each_completion_is_scored_before_it_is_answered(
    make_engine, tiny_model_dir
):
    task = _CountingTask()
    checker = _checker(tiny_model_dir, task)
    worker, sent = answering_worker(await make_engine(), 128, checker)
    await worker.handle(generate(["g0-s0-a0", "g0-s1-a0"], reference={"answer": 12}))
    await settle(worker)
    checker.close()
    completions = [c for m in sent for c in m.completions()]
    assert [m.scored for m in sent] == [True] * len(sent) and len(completions) == 2
    tokenizer = load_tokenizer(tiny_model_dir)
    texts = {tokenizer.decode(c.output_ids.tolist(), skip_special_tokens=True) for c in completions}
    assert {text for text, _ in task.calls} == texts  # each completion's own text
    assert [reference for _, reference in task.calls] == [{"answer": 12}] * 2
    for c in completions:
        assert (c.reward, c.verdict) == (1.0, Verdict.OK) and c.detail.endswith("chars")
        assert c.check_retries == 0


@pytest.mark.parametrize("retries,verdict", [(2, Verdict.OK), (1, Verdict.ERROR)])
async def test_a_failed_check_is_run_again_on_the_worker_up_to_reward_retries(
    make_engine, tiny_model_dir, retries, verdict
):
    task = _CountingTask(failures=2)
    checker = _checker(tiny_model_dir, task)
    worker, sent = answering_worker(await make_engine(), 128, checker, f"reward.retries={retries}")
    await worker.handle(generate(["g0-s0-a0"]))
    await settle(worker)
    checker.close()
    (completion,) = sent[0].completions()
    assert len(task.calls) == retries + 1 and completion.verdict is verdict
    assert completion.check_retries == retries  # the controller counts them (reward/retries)
    if verdict is Verdict.ERROR:
        assert completion.reward == 0.0 and "the verifier crashed" in completion.detail
