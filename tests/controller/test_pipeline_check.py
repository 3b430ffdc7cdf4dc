"""The pipeline computes what the method says, end to end (issue 32): in a real asynchronous
run (eta = 2, recomputed proximal policy, real processes, the tiny model learning the letter
task), for every loss token of the audited steps (trainer.audit_steps):

- the proximal log-prob the loss used equals an independent recomputation under the weights
  the trainer held at the start of that step (saved by the trainer before the step), and
  those weights are the version the step was sent for, as published;
- the behaviour log-prob equals a recomputation under the published weights of the version
  that sampled the token (recorded per token), so stale tokens are weighed by the right
  policy.

"Independent": a plain per-sequence transformers forward (padding-free, one sequence at a
time), not the trainer's packed forward (areal.models.logprobs). The audited steps must hold
stale tokens whose proximal and behaviour log-probs differ by far more than the tolerance,
or the check would pass on a pipeline that confused the two.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from areal.config import load_config
from areal.controller import Controller
from areal.models.hf import load_model
from areal.models.weights import copy_into_model, load_tensors
from areal.records import read_records
from areal.workers.trainer.audit import audit_dir, load_batch
from areal.workers.trainer.publish import version_dir

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
STEPS, AUDITED = 6, (3, 6)
ATOL = 1e-5
"""Engine or packed forward vs a plain forward, float32, on the tiny model's small logits."""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir) -> Path:
    run_dir = tmp_path_factory.mktemp("pipeline") / "run"
    cfg = load_config(
        overrides=[
            f"model.path={tiny_model_dir}",
            f"run_dir={run_dir}",
            "task.name=letter_task:LetterTask",
            "mode=async",
            "staleness.eta=2",
            "trainer.ppo.prox_logp=recompute",
            f"trainer.total_steps={STEPS}",
            "trainer.batch_size=8",
            "task.group_size=4",
            "rollout.max_new_tokens=24",
            "rollout.num_workers=2",
            "trainer.lr=3e-3",
            f"trainer.audit_steps=[{','.join(map(str, AUDITED))}]",
            "eval.every_steps=0",
            "eval.max_prompts=1",
            f"weight_sync.keep_versions={STEPS + 1}",
            "trainer.checkpoint_every=0",
            "logging.progress=false",
            "logging.tensorboard=false",
            "controller.heartbeat_interval_s=0.5",
        ]
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(HERE))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        summary = asyncio.run(Controller(cfg).run())
    assert summary["steps"] == STEPS
    return run_dir


def _weights(model_dir: str, version: int, run_dir: Path) -> dict[str, torch.Tensor]:
    """The published weights of `version` (version 0: the model the run started from)."""
    return load_tensors(model_dir if version == 0 else version_dir(run_dir, version))


def _plain_logprobs(
    model: torch.nn.Module, tokens: np.ndarray, cu_seqlens: np.ndarray, temperature: float
) -> np.ndarray:
    """[N] log-prob of each token given the ones before it in its sequence (0 for a first
    token), one unpadded sequence per forward."""
    out = np.zeros(len(tokens), np.float64)
    with torch.no_grad():
        for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True):
            ids = torch.from_numpy(tokens[start:end].astype(np.int64))[None]
            logits = model(input_ids=ids).logits[0, :-1].double() / temperature
            out[start + 1 : end] = (
                torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1).numpy()
            )
    return out


def _model(tiny_model_dir: str, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = load_model(tiny_model_dir)
    copy_into_model(model, list(tensors.items()), strict=True)
    return model.eval()


@pytest.mark.parametrize("step", AUDITED)
def test_the_loss_used_the_proximal_and_behaviour_policies_the_method_names(
    run_dir, tiny_model_dir, step
):
    batch = load_batch(run_dir, step)
    version = batch["version"]
    record = next(r for r in read_records(run_dir) if r["kind"] == "step" and r["step"] == step)
    assert record["version"] == version + 1
    start = load_tensors(audit_dir(run_dir, step) / "weights")
    published = _weights(tiny_model_dir, version, run_dir)
    assert start.keys() == published.keys()
    for name, tensor in start.items():  # the trainer held the version it was sent for
        assert torch.equal(tensor, published[name]), name

    mask = batch["loss_mask"]
    tokens, cu = batch["token_ids"], batch["cu_seqlens"]
    prox = _plain_logprobs(_model(tiny_model_dir, start), tokens, cu, temperature=1.0)
    prox_err = np.abs(batch["prox_logprobs"][mask] - prox[mask])
    assert prox_err.max() < ATOL, (
        f"prox: max |diff| {prox_err.max():.2e}, mean {prox_err.mean():.2e}"
    )

    versions = batch["versions"]
    sampled_by = sorted(set(versions[mask].tolist()))
    assert min(sampled_by) < version, f"step {step} trained no stale token: {sampled_by}"
    for v in sampled_by:
        behav = _plain_logprobs(
            _model(tiny_model_dir, _weights(tiny_model_dir, v, run_dir)),
            tokens,
            cu,
            temperature=1.0,
        )
        these = mask & (versions == v)
        err = np.abs(batch["behav_logprobs"][these] - behav[these])
        assert err.max() < ATOL, f"behav v{v}: max |diff| {err.max():.2e}, mean {err.mean():.2e}"

    stale = mask & (versions < version)
    gap = np.abs(batch["prox_logprobs"][stale] - batch["behav_logprobs"][stale])
    assert gap.max() > 20 * ATOL, f"stale tokens: max |prox - behav| {gap.max():.2e}"
