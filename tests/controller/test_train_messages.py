"""The controller's Train messages, built straight from trajectories (pack_arrays +
plan_shard_sequences), equal those of the reference path: pack the whole batch, shard it
with shard_batch, convert each shard. The fast path exists because the reference one
dominated the controller's CPU time at cluster scale (bench/cluster.py, table f)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from areal.algorithms.shaping import training_batch
from areal.algorithms.sharding import shard_batch
from areal.config import load_config
from areal.controller.train_driver import train_messages
from areal.controller.ledger import Group, Ledger, Purpose, Sample, Stage
from areal.messages import Completions, FinishReason, Generated, Train
from areal.tasks.base import Prompt, RewardOutcome, Verdict
from areal.types import Trajectory, pack, pack_arrays


def _groups(rng: np.random.Generator, num_groups: int, group_size: int) -> list[Group]:
    groups = []
    for g in range(num_groups):
        prompt = rng.integers(0, 50, rng.integers(1, 6)).astype(np.int32)
        group = Group(
            group_id=g,
            purpose=Purpose.TRAIN,
            prompt=Prompt(prompt_id=f"p{g}", text="", reference=None),
            prompt_ids=prompt,
            admitted_version=0,
        )
        for i in range(group_size):
            n = int(rng.integers(1, 40))
            ids, logprobs, versions = (
                rng.integers(0, 50, n),
                -rng.random(n),
                np.sort(rng.integers(0, 3, n)),
            )
            if i % 2:  # a rollout worker's dtypes: the trajectory keeps the arrays uncopied
                ids, logprobs, versions = (
                    ids.astype(np.int32),
                    logprobs.astype(np.float32),
                    versions.astype(np.int32),
                )
            trajectory = Trajectory.from_generation(
                prompt_id=f"p{g}",
                group_id=g,
                prompt_ids=prompt,
                output_ids=ids,
                output_logprobs=logprobs,
                output_versions=versions,
                finish_reason=str(rng.choice(["stop", "length"])),
            )
            trajectory.reward = float(rng.integers(0, 2))
            group.samples.append(
                Sample(group_id=g, index=i, stage=Stage.DONE, trajectory=trajectory)
            )
        groups.append(group)
    return groups


def _reference(groups: list[Group], cfg, num_ranks: int, num_minibatches: int) -> list[dict]:
    trajectories = [t for g in groups for t in g.trajectories()]
    batch, advantages = training_batch(trajectories, pack(trajectories), cfg)
    out = []
    for shard in shard_batch(batch, advantages, num_ranks, num_minibatches):
        part = shard.batch
        out.append(
            dict(
                token_ids=part.token_ids.numpy().astype(np.int32),
                logprobs=part.logprobs.numpy(),
                versions=part.versions.numpy().astype(np.int32),
                loss_mask=part.loss_mask.numpy(),
                cu_seqlens=part.cu_seqlens.numpy(),
                rewards=part.rewards.numpy(),
                group_ids=part.group_ids.numpy(),
                advantages=shard.advantages.numpy(),
                minibatch_sizes=shard.minibatch_sizes,
                minibatch_loss_tokens=shard.minibatch_loss_tokens,
                minibatch_loss_seqs=shard.minibatch_loss_seqs,
            )
        )
    return out


SHAPING = [
    "trainer.advantage.overlong_buffer=10",
    "trainer.advantage.mask_truncated=true",
    "rollout.max_new_tokens=40",
]


@pytest.mark.parametrize(
    "num_ranks,num_minibatches,shaping", [(1, 1, []), (3, 2, []), (8, 4, SHAPING), (40, 1, SHAPING)]
)
def test_train_messages_equal_the_pack_and_shard_path(num_ranks, num_minibatches, shaping):
    rng = np.random.default_rng(num_ranks)
    groups = _groups(rng, num_groups=6, group_size=4)  # 24 sequences: 40 ranks get some empty
    cfg = load_config(
        overrides=[
            f"trainer.num_ranks={num_ranks}",
            f"trainer.num_minibatches={num_minibatches}",
            "task.group_size=4",
            "trainer.batch_size=24",
            *shaping,
        ]
    )
    messages = train_messages(cfg, 3, 2, groups)
    reference = _reference(groups, cfg, num_ranks, num_minibatches)
    assert len(messages) == len(reference) == num_ranks
    assert all(msg.step == 3 and msg.version == 2 for msg in messages)
    for msg, ref in zip(messages, reference, strict=True):
        for name, expected in ref.items():
            got = getattr(msg, name)
            if isinstance(expected, list):
                assert got == expected, name
            else:
                assert got.dtype == expected.dtype, (name, got.dtype, expected.dtype)
                np.testing.assert_array_equal(got, expected, err_msg=name)


def test_pack_arrays_of_nothing_is_empty_arrays():
    arrays = pack_arrays([])
    assert arrays["cu_seqlens"].tolist() == [0]
    assert all(len(a) == 0 for name, a in arrays.items() if name != "cu_seqlens")


def _recorded_groups(rng: np.random.Generator, together: bool) -> list[Group]:
    """Six groups of four, their completions recorded by a Ledger as rollout workers answer:
    each worker's in one Completions (`together`), or each in a Generated of its own."""
    ledger, worker = Ledger(), b"rollout-0"
    groups = [
        ledger.add_group(
            Prompt(prompt_id=f"p{g}", text="", reference=None),
            rng.integers(0, 50, 1 + g % 5).astype(np.int32),
            size=4,
            version=0,
            position=g,
        )
        for g in range(6)
    ]
    samples = list(ledger.pending)
    ledger.pending.clear()
    answers = []
    for sample in samples:
        ledger.start_generation(sample, worker, now=1.0)
        n = int(rng.integers(1, 40))
        versions = np.sort(rng.integers(0, 3, n)).astype(np.int32)
        answers.append(
            Generated(
                request_id=sample.request_id,
                output_ids=rng.integers(0, 50, n).astype(np.int32),
                logprobs=-rng.random(n).astype(np.float32),
                versions=versions,
                finish_reason=FinishReason.STOP if n % 3 else FinishReason.LENGTH,
                generation_s=n / 8,
                num_interruptions=int(versions[-1] - versions[0]),
            )
        )
    if together:
        for at in range(0, len(answers), 8):
            assert (
                len(ledger.finish_completions(Completions.of(answers[at : at + 8]), worker).samples)
                == 8
            )
    else:
        assert all(ledger.finish_generation(answer, worker) for answer in answers)
    for sample in samples:
        ledger.start_scoring(sample, b"reward-0")
        reward = float(rng.integers(0, 2))
        ledger.finish_scoring(
            sample.request_id,
            RewardOutcome(reward=reward, verdict=Verdict.OK if reward else Verdict.WRONG),
            b"reward-0",
        )
    assert all(g.done for g in groups)
    return groups


def test_completions_recorded_together_train_as_each_alone_would():
    # A Completions' samples keep where their completion lies and build their trajectories
    # when the batch is packed (after their rewards came); each Generated's is built at
    # once. The Train messages of the two must be equal, field by field.
    cfg = load_config(
        overrides=[
            "trainer.num_ranks=3",
            "trainer.num_minibatches=2",
            "task.group_size=4",
            "trainer.batch_size=24",
        ]
    )
    together = _recorded_groups(np.random.default_rng(7), together=True)
    assert all(s.trajectory is None for g in together for s in g.samples)  # not yet built
    alone = _recorded_groups(np.random.default_rng(7), together=False)
    got, expected = train_messages(cfg, 1, 2, together), train_messages(cfg, 1, 2, alone)
    for msg, ref in zip(got, expected, strict=True):
        for name in (f.name for f in dataclasses.fields(Train)):
            a, b = getattr(msg, name), getattr(ref, name)
            if isinstance(a, np.ndarray):
                assert a.dtype == b.dtype and np.array_equal(a, b), name
            else:
                assert a == b, name
    for g_together, g_alone in zip(together, alone, strict=True):
        for s, t in zip(g_together.samples, g_alone.samples, strict=True):
            assert s.generated.timings == t.generated.timings
            assert s.generated.reward == t.generated.reward
            assert s.generated.finish_reason == t.generated.finish_reason
            for read in (Trajectory.oldest_version, Trajectory.newest_version):  # off the runs
                assert read(s.generated) == read(t.generated) == read(_joined(t.generated))


def _joined(t: Trajectory) -> Trajectory:
    """`t` built from its full [T] arrays (its versions read token by token)."""
    return Trajectory(
        prompt_id=t.prompt_id,
        group_id=t.group_id,
        token_ids=t.token_ids,
        logprobs=t.logprobs,
        versions=t.versions,
        loss_mask=t.loss_mask,
        num_prompt_tokens=t.num_prompt_tokens,
    )
