"""Per-request sampling seeds (areal.seeds): named by what a sample is, stable across
machines and Python versions (golden values), in range, and distinct per name."""

from __future__ import annotations

import collections

import numpy as np

from areal.seeds import (
    SEED_BITS,
    continuation_seed,
    derive_seed,
    eval_group_seeds,
    eval_sample_seed,
    train_group_seeds,
    train_sample_seed,
    uniform,
)

GOLDEN_TRAIN = 7115781634935833515
"""The first 8 bytes of SHAKE-128("str:train\x1fint:1\x1fint:0"), little-endian, >> 1."""
GOLDEN_EVAL = 3329618004147204468
GOLDEN_CONTINUE = 5605675114603067850


def test_seeds_are_golden_values_the_same_on_every_machine():
    # SHAKE-128 and BLAKE2b of the parts' text: no dependence on PYTHONHASHSEED, platform
    # or version.
    assert train_sample_seed(1, 0, 0) == GOLDEN_TRAIN
    assert eval_sample_seed(1, "eval-0", 0) == GOLDEN_EVAL
    assert derive_seed("continue", 5, 3) == continuation_seed(5, 3) == GOLDEN_CONTINUE
    assert uniform(5, 0) == 0.9172965288162231 and uniform(5, 1) == 0.8446887135505676


def test_each_name_gets_its_own_seed_in_range():
    seeds = [
        train_sample_seed(run, pos, i) for run in (1, 2) for pos in range(50) for i in range(8)
    ]
    seeds += [eval_sample_seed(1, f"eval-{p}", i) for p in range(50) for i in range(8)]
    seeds += [continuation_seed(seeds[0], k) for k in range(1, 50)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 1 << SEED_BITS for s in seeds)
    assert derive_seed("train", 1, 2, 3) != derive_seed("train", 1, 23)  # parts are separated
    assert derive_seed(1) != derive_seed("1")


def test_a_groups_seeds_are_its_samples_whatever_the_group_size_or_int_type():
    # One hash call for a group (its stream's first words): sample i's seed is the same
    # alone, in a group of any size, and with plain ints written out or not ("int64:1" is
    # another name than "int:1").
    for run, position, size in [(0, 0, 1), (1, 5, 16), (-3, 1 << 40, 64)]:
        group = train_group_seeds(run, position, size)
        assert group == [train_sample_seed(run, position, i) for i in range(size)]
        assert train_group_seeds(run, position, size + 3)[:size] == group
    assert eval_group_seeds(1, "p", 4) == [eval_sample_seed(1, "p", i) for i in range(4)]
    assert train_group_seeds(np.int64(1), 0, 2) != train_group_seeds(1, 0, 2)
    assert train_group_seeds(1, 0, 2) != eval_group_seeds(1, "0", 2)


def test_a_continuation_at_zero_tokens_is_the_request_itself():
    assert continuation_seed(1234, 0) == 1234 and continuation_seed(1234, 3) != 1234


def test_draws_are_uniform_on_a_float32_grid():
    draws = [uniform(99, t) for t in range(20000)]
    assert all(0.0 <= u < 1.0 and (u * (1 << 24)).is_integer() for u in draws)
    deciles = collections.Counter(int(u * 10) for u in draws)
    assert all(abs(deciles[d] - 2000) < 200 for d in range(10)), deciles  # ~4.7 sigma
