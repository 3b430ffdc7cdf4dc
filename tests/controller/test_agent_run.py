"""Agent episodes as real processes: a run whose samples are an agent (agent_two_segments.py)
calling its rollout worker's endpoint through the real `openai` client, twice per episode
in two conversations. Checked on what the trainer was sent (logging.save_batches): each
episode is two training sequences with their own prompts, each with its reward (the
discounted return of its last call plus its earlier calls' rewards); every sampled token
carries a version and log-prob; the step records count calls and segments."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from areal.config import load_config
from areal.controller import Controller
from areal.models.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
BATCH, GROUP, STEPS = 8, 4, 2


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("agent") / "run"
    cfg = load_config(
        overrides=[
            f"model.path={tiny_model_dir}",
            f"run_dir={run_dir}",
            "task.name=tool_arithmetic",
            "task.params.num_eval=4",
            "agent.function=agent_two_segments:run",
            "rollout.max_new_tokens=16",
            f"trainer.total_steps={STEPS}",
            f"trainer.batch_size={BATCH}",
            f"task.group_size={GROUP}",
            "eval.every_steps=0",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.save_batches=true",
            "controller.heartbeat_interval_s=0.5",
        ]
    )

    async def go():
        ctl = Controller(cfg)
        task = asyncio.create_task(ctl.run())
        records = [record async for record in ctl.events()]
        return records, await task

    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(HERE))  # the agent imports here and in the rollout worker
        mp.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        records, summary = asyncio.run(go())
    batches = [dict(np.load(p)) for p in sorted((run_dir / "batches").glob("step_*.npz"))]
    return {
        "records": records,
        "summary": summary,
        "batches": batches,
        "tokenizer": load_tokenizer(tiny_model_dir),
    }


def test_each_agent_episode_trains_as_two_segments_with_their_rewards(run):
    assert run["summary"]["steps"] == STEPS and run["summary"]["dropped_groups"] == {}
    tokenizer = run["tokenizer"]
    for batch in run["batches"]:
        cu, mask = batch["cu_seqlens"], batch["loss_mask"]
        assert len(cu) - 1 == 2 * BATCH  # every episode: two sequences
        again, first = [], []
        for i in range(len(cu) - 1):
            seq = slice(cu[i], cu[i + 1])
            sampled = np.flatnonzero(mask[seq])
            prompt = tokenizer.decode(batch["token_ids"][seq][: sampled[0]])
            assert 1 <= len(sampled) <= 6 and (batch["versions"][seq][sampled] >= 0).all()
            assert (batch["logprobs"][seq][sampled] <= 0).all()
            (again if prompt.endswith("again\n") else first).append(float(batch["rewards"][i]))
        assert len(again) == len(first) == BATCH
        # Second call: its own reward r2 in {0, 1}; first segment: 0.5 + r2 (discount 1).
        assert set(again) <= {0.0, 1.0} and set(first) <= {0.5, 1.5}
        assert sorted(first) == sorted(r + 0.5 for r in again)


def test_step_records_count_calls_and_segments(run):
    steps = [r for r in run["records"] if r["kind"] == "step"]
    assert len(steps) == STEPS
    for record in steps:
        assert record["episode/calls_mean"] == 2.0 and record["episode/segments_mean"] == 2.0
        assert record["episode/split_fraction"] == 1.0
        assert record["episode/ends"] == {"agent": BATCH}
        assert record["episode/endpoint_decode_s_mean"] > 0
