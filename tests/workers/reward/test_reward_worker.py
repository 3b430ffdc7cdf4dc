"""The reward worker over a real socket: one Score carries a group's completions and one
Scored answers for all of them, in order; a completion that cannot be decoded is an ERROR
outcome of its own, and the rest of its group is still checked; a Score that fails as a
whole is reported with every request id it held."""

from __future__ import annotations

import asyncio

import numpy as np
import zmq.asyncio

from areal.config import config_to_dict, load_config
from areal.messages import Ready, Score, Scored, Shutdown, Welcome, WorkerError
from areal.models.tokenizer import load_tokenizer
from areal.tasks.base import Verdict
from areal.transport import RouterChannel
from areal.workers.reward.worker import RewardWorker


async def _score(
    model_dir: str, score: Score, break_decode_of: str | None = None, break_checks: bool = False
) -> Scored | WorkerError:
    """Serve a real RewardWorker against a bare ROUTER, send `score`, return its answer.
    `break_decode_of`: the tokenizer raises on that completion's text; `break_checks`: its
    checker pool raises (unit seams)."""
    ctx = zmq.asyncio.Context()
    channel = RouterChannel(ctx, "127.0.0.1", 0)
    worker = RewardWorker(channel.address, "reward-0", secret="s")
    serving = asyncio.create_task(worker.serve())
    try:
        identity, msg = await asyncio.wait_for(channel.recv(), 30)
        await channel.send(
            identity,
            Welcome(
                config=config_to_dict(load_config(overrides=[f"model.path={model_dir}"])), version=0
            ),
        )
        while not isinstance(msg, Ready):
            identity, msg = await asyncio.wait_for(channel.recv(), 60)
        if break_decode_of is not None:
            decode = worker.checker.tokenizer.decode

            def failing(ids, **kwargs):
                text = decode(ids, **kwargs)
                if text == break_decode_of:
                    raise ValueError("no such token")
                return text

            worker.checker.tokenizer.decode = failing
        if break_checks:

            async def broken(*args, **kwargs):
                raise RuntimeError("the checker pool is broken")

            worker.checker.pool.check = broken
        await channel.send(identity, score)
        while not isinstance(msg, (Scored, WorkerError)):
            identity, msg = await asyncio.wait_for(channel.recv(), 60)
        await channel.send(identity, Shutdown(reason="test"))
        await asyncio.wait_for(serving, 60)
        return msg
    finally:
        channel.close()
        ctx.term()


def _ids(tokenizer, text: str) -> np.ndarray:
    return np.array(tokenizer.encode(text, add_special_tokens=False), np.int32)


def test_one_scored_answers_a_whole_group_in_order(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    texts = ["# 12", "# 7", "no answer", "#12"]
    scored = asyncio.run(
        _score(
            tiny_model_dir,
            Score(
                request_ids=["g0-s0-a0", "g0-s1-a0", "g0-s2-a0", "g0-s3-a0"],
                prompt_id="p",
                completion_ids=[_ids(tokenizer, t) for t in texts],
                reference=12,
            ),
        )
    )
    assert scored.request_ids == ["g0-s0-a0", "g0-s1-a0", "g0-s2-a0", "g0-s3-a0"]
    assert scored.rewards == [1.0, 0.0, 0.0, 1.0]
    assert scored.verdicts[0] is Verdict.OK and scored.verdicts[3] is Verdict.OK
    assert scored.verdicts[1] is not Verdict.OK and scored.verdicts[2] is not Verdict.OK
    assert len(scored.details) == len(scored.check_s) == 4


def test_a_completion_that_cannot_be_decoded_is_an_error_of_its_own(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    scored = asyncio.run(
        _score(
            tiny_model_dir,
            Score(
                request_ids=["a", "b"],
                prompt_id="p",
                completion_ids=[_ids(tokenizer, "# 5"), _ids(tokenizer, "# 6")],
                reference=5,
            ),
            break_decode_of="# 6",
        )
    )
    assert scored.request_ids == ["a", "b"]
    assert scored.rewards == [1.0, 0.0] and scored.verdicts == [Verdict.OK, Verdict.ERROR]
    assert "could not decode the completion" in scored.details[1]
    assert "no such token" in scored.details[1]


def test_a_score_that_fails_as_a_whole_names_every_request_it_held(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = [f"g3-s{i}-a0" for i in range(20)]  # more than a short header list: a big group
    error = asyncio.run(
        _score(
            tiny_model_dir,
            Score(
                request_ids=ids,
                prompt_id="p",
                completion_ids=[_ids(tokenizer, "# 5")] * 20,
                reference=5,
            ),
            break_checks=True,
        )
    )
    assert isinstance(error, WorkerError) and not error.fatal
    assert error.request_ids == ids
    assert "the checker pool is broken" in error.error
