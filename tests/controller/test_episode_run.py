"""Multi-turn episodes as real processes: a run whose rollout worker answers every first
turn with a program run in the real sandbox (episode_env.py: fine, crashing, timing out,
a failing environment, an episode that never ends), then the same run resumed from its
checkpoint while episodes were in flight.

Checked on what the trainer was sent (logging.save_batches) and what it reported:
observation tokens are in the context but never trained (loss mask False, version -1,
log-prob 0, and the trainer's loss-token count excludes them); every model token's
behaviour log-prob equals the trainer-side recomputation under the weights of its own
version, with the observations in the context (one kind of episode waits for a weight
update between its turns, so some episode always spans versions); failures are outcomes,
never lost episodes.
"""

from __future__ import annotations

import asyncio
import collections
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from areal.config import load_config
from areal.controller import Controller
from areal.models.hf import load_model
from areal.models.tokenizer import load_tokenizer
from areal.models.logprobs import packed_logprobs
from areal.models.weights import copy_into_model, load_tensors

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
BATCH, GROUP, FIRST, TOTAL = 8, 4, 4, 6


def _config(run_dir: Path, model_dir: str, steps: int):
    return load_config(
        overrides=[
            f"model.path={model_dir}",
            f"run_dir={run_dir}",
            "task.name=letter_task:LetterTask",
            "task.params.num_eval=5",
            "episode.environment=episode_env:SandboxScriptEnvironment",
            "episode.max_turns=3",
            f"episode.params.weights_dir={run_dir / 'weights'}",
            "episode.max_turn_tokens=24",
            "rollout.max_new_tokens=300",
            f"trainer.total_steps={steps}",
            f"trainer.batch_size={BATCH}",
            f"task.group_size={GROUP}",
            "staleness.eta=1",
            "trainer.checkpoint_every=2",
            "trainer.lr=1e-2",
            "eval.every_steps=0",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.save_batches=true",
            "weight_sync.keep_versions=100",
            "controller.heartbeat_interval_s=0.5",
        ]
    )


async def _run(cfg, resume: bool) -> dict:
    ctl = Controller(cfg, resume=resume)
    run = asyncio.create_task(ctl.run())
    records = [record async for record in ctl.events()]
    return {"ctl": ctl, "records": records, "summary": await run}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("episodes") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(HERE))  # the task and environment import here and in workers
        mp.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        first = asyncio.run(_run(_config(run_dir, tiny_model_dir, FIRST), resume=False))
        batches_of_first = sorted((run_dir / "batches").glob("step_*.npz"))
        second = asyncio.run(_run(_config(run_dir, tiny_model_dir, TOTAL), resume=True))
    return {
        "first": first,
        "second": second,
        "run_dir": run_dir,
        "batches": [dict(np.load(p)) for p in batches_of_first],
    }


def _steps(run: dict) -> list[dict]:
    return [r for r in run["records"] if r["kind"] == "step"]


def _sequences(batch: dict):
    """(token ids, loss mask, versions, log-probs, index of the first output token) per
    sequence of a saved batch."""
    cu = batch["cu_seqlens"]
    for s in range(len(cu) - 1):
        part = slice(cu[s], cu[s + 1])
        mask = batch["loss_mask"][part]
        yield (
            batch["token_ids"][part],
            mask,
            batch["versions"][part],
            batch["logprobs"][part],
            int(np.argmax(mask)),
        )


def _observation_spans(mask: np.ndarray, start: int) -> list[slice]:
    spans, i = [], start
    while i < len(mask):
        if mask[i]:
            i += 1
            continue
        j = i
        while j < len(mask) and not mask[j]:
            j += 1
        spans.append(slice(i, j))
        i = j
    return spans


def test_observation_tokens_are_context_and_never_trained(runs, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    texts = []
    for batch, step in zip(runs["batches"], _steps(runs["first"]), strict=True):
        loss_tokens = 0
        for tokens, mask, versions, logprobs, start in _sequences(batch):
            assert mask[start] and not mask[:start].any()
            for span in _observation_spans(mask, start):
                assert (versions[span] == -1).all() and (logprobs[span] == 0.0).all()
                texts.append(tokenizer.decode(tokens[span].tolist()))
            loss_tokens += int(mask.sum())
        assert step["train/num_loss_tokens"] == loss_tokens == int(batch["loss_mask"].sum())
    # The observations are the sandbox's answers, as the environment wrote them.
    assert texts and all(t.startswith("\n>") for t in texts)
    assert any(t == "\n>42\n" for t in texts)
    assert any("ZeroDivisionError" in t for t in texts)  # a crashing tool: an observation
    assert any("status: timeout" in t for t in texts)  # a tool past its time limit


def test_model_token_logprobs_are_those_of_their_version_with_observations_in_context(
    runs, tiny_model_dir
):
    run_dir, batches = runs["run_dir"], runs["batches"]
    model = load_model(tiny_model_dir)
    versions_needed = sorted({int(v) for b in batches for v in np.unique(b["versions"]) if v >= 0})
    num_spanning = 0
    for b in batches:
        for _, mask, versions, _, _ in _sequences(b):
            num_spanning += len(set(versions[mask].tolist())) > 1
    for version in versions_needed:
        if version > 0:
            copy_into_model(model, load_tensors(run_dir / "weights" / f"v{version:06d}"))
        for i, b in enumerate(batches):
            at = (b["versions"] == version) & b["loss_mask"]
            if at.any():
                with torch.no_grad():
                    lp = packed_logprobs(
                        model,
                        torch.from_numpy(b["token_ids"]).long(),
                        torch.from_numpy(b["cu_seqlens"]),
                        temperature=1.0,
                    ).numpy()
                diff = np.abs(lp[at] - b["logprobs"][at])
                assert diff.max() < 2e-4, (
                    f"batch {i}, version {version}: max diff "
                    f"{diff.max():.2e}, mean {diff.mean():.2e}"
                )
    assert num_spanning > 0, "no episode was sampled by more than one policy version"


def test_failing_tools_and_environments_are_outcomes_not_lost_episodes(runs):
    first = runs["first"]
    steps = _steps(first)
    assert [r["step"] for r in steps] == list(range(1, FIRST + 1))
    ends = collections.Counter()
    for r in steps:
        ends.update(r["episode/ends"])
        assert r["episode/turns_max"] <= 3 and r["episode/observation_tokens_mean"] > 0
    assert {"environment", "turn_limit"} <= set(ends), ends
    assert sum(r["episode/tool_errors"] for r in steps) > 0
    verdicts = collections.Counter()
    for r in steps:
        verdicts.update(r["reward/verdicts"])
    assert verdicts["error"] > 0  # the failing environment: 'could not judge', not 'wrong'
    # ... so its training group is dropped and replaced (reward.on_error=drop, the default):
    # no episode that ended in an error is trained as a wrong answer.
    assert "error" not in ends, ends
    assert sum(r.get("rollout/dropped_groups/reward_error", 0) for r in steps) > 0
    trained = first["ctl"].ledger.trained_group_ids
    assert len(trained) == len(set(trained)) == FIRST * BATCH // GROUP
    evals = [r for r in first["records"] if r["kind"] == "eval"]
    assert evals and all(r["eval/turns_mean"] >= 1 for r in evals)


def test_a_run_resumed_with_episodes_in_flight_continues_them_from_scratch(runs):
    first, second = runs["first"], runs["second"]
    assert [r["step"] for r in _steps(second)] == [FIRST + 1, TOTAL]
    assert all(r["episode/turns_mean"] >= 1 for r in _steps(second))
    by_group = {e["group_id"]: e["position"] for e in first["ctl"].core.admission.log}
    first_trained = {by_group[g] for g in first["ctl"].ledger.trained_group_ids}
    by_group = {e["group_id"]: e["position"] for e in second["ctl"].core.admission.log}
    second_trained = {by_group[g] for g in second["ctl"].ledger.trained_group_ids}
    assert len(second_trained) == (TOTAL - FIRST) * BATCH // GROUP
    assert not first_trained & second_trained  # no prompt trained twice
    resumed = [r for r in second["records"] if r["kind"] == "event" and r["event"] == "resumed"]
    assert resumed and resumed[0]["regenerated_groups"] > 0  # episodes were in flight
