"""Per-request sampling seeds (areal.seeds): named by what a sample is, stable across
machines and Python versions (golden values), in range, and distinct per name."""

from __future__ import annotations

import collections

import numpy as np

from areal.seeds import (
    SEED_BITS,
    continuation_seed,
    derive_seed,
    eval_sample_seed,
    train_sample_seed,
    uniform,
)


def test_seeds_are_golden_values_the_same_on_every_machine():
    # BLAKE2b of the parts' text: no dependence on PYTHONHASHSEED, platform or version.
    assert train_sample_seed(1, 0, 0) == 8908042596128927087
    assert eval_sample_seed(1, "eval-0", 0) == 3954305059170323206
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


def test_a_training_seed_is_derive_seed_of_its_parts_whatever_their_int_type():
    # train_sample_seed writes derive_seed's text itself for plain ints (once per sample
    # dispatched); any other integer type goes through derive_seed.
    for run, position, index in [(0, 0, 0), (1, 5, 15), (-3, 1 << 40, 7)]:
        assert train_sample_seed(run, position, index) == derive_seed("train", run, position, index)
    assert train_sample_seed(np.int64(1), 0, 0) == derive_seed("train", np.int64(1), 0, 0)
    assert train_sample_seed(np.int64(1), 0, 0) != train_sample_seed(1, 0, 0)  # "int64:1"


def test_a_continuation_at_zero_tokens_is_the_request_itself():
    assert continuation_seed(1234, 0) == 1234 and continuation_seed(1234, 3) != 1234


def test_draws_are_uniform_on_a_float32_grid():
    draws = [uniform(99, t) for t in range(20000)]
    assert all(0.0 <= u < 1.0 and (u * (1 << 24)).is_integer() for u in draws)
    deciles = collections.Counter(int(u * 10) for u in draws)
    assert all(abs(deciles[d] - 2000) < 200 for d in range(10)), deciles  # ~4.7 sigma
