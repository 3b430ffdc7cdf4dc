"""Per-request sampling seeds: every sample gets its own random stream, named by what it is.

Why: an inference engine that draws every token of a batch from one random stream makes a
sample's tokens depend on its batch neighbours (how many rows each forward had, in which
order requests arrived), which depends on timing. With a seed per request, a sample's tokens
depend only on its seed, its prompt and the weights that sampled it, so that

- the same run seed gives the same synchronous run twice (tests/controller/
  test_reproducible_run.py), whatever the batch composition or the number of rollout
  workers;
- two runs compared by seed (bench/paired.py) draw the same random numbers for the same
  prompt and sample: common random numbers, which shrink the variance of their difference.

Seeds are named, not counted: a training group by the run seed and the prompt's draw
position in the task's stream; an evaluation group by the run seed and the held-out prompt's
id, so every evaluation round (every version, every arm of a comparison) samples each
held-out problem with the same random numbers. Sample i of a group takes the i-th 63-bit
word of its group's stream (SHAKE-128 of the name's text, an extendable-output hash), so a
group's seeds come from one hash call however large the group (the controller writes
thousands of groups' seeds a step at cluster scale), and sample i's seed is the same in a
group of any size. A continuation (the sequence resubmitted after an interruption, the next
turn of an episode) derives its seed from the request's and its position, so no two
segments share a stream.

`derive_seed` is a hash (BLAKE2b of the parts' text). Both are the same on every machine and
Python version. Neither samples anything: engines turn a seed into draws (workers/rollout).
"""

from __future__ import annotations

import hashlib
import struct

SEED_BITS = 63
"""Seeds are non-negative and below 2**63 (fit a signed 64-bit integer, msgpack, vLLM)."""


def derive_seed(*parts: int | str) -> int:
    """A seed in [0, 2**63) from `parts` (ints and strings); equal parts give equal seeds."""
    return _seed_of(_name(*parts))


def _name(*parts: int | str) -> str:
    """The text that names `parts`: each with its type, so 1 and "1" differ, separated so
    that (1, 23) and (12, 3) differ."""
    return "\x1f".join(f"{type(p).__name__}:{p}" for p in parts)


def _seed_of(text: str) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


def _words(name: str, count: int) -> list[int]:
    """The first `count` seeds of the stream `name`: 8-byte little-endian words of its
    SHAKE-128 output, each cut to SEED_BITS."""
    digest = hashlib.shake_128(name.encode()).digest(8 * count)
    return [word >> (64 - SEED_BITS) for word in struct.unpack(f"<{count}Q", digest)]


def train_group_seeds(run_seed: int, position: int, size: int) -> list[int]:
    """The seeds of the `size` samples of the training prompt drawn at `position` of the
    task's stream, in index order."""
    if type(run_seed) is type(position) is int:  # _name's text, written out
        return _words(f"str:train\x1fint:{run_seed}\x1fint:{position}", size)
    return _words(_name("train", run_seed, position), size)


def train_sample_seed(run_seed: int, position: int, index: int) -> int:
    """Sample `index` of the training prompt drawn at `position`: its group's seed
    `index` (`train_group_seeds`)."""
    return train_group_seeds(run_seed, position, index + 1)[index]


def eval_group_seeds(run_seed: int, prompt_id: str, size: int) -> list[int]:
    """The seeds of the `size` samples of held-out prompt `prompt_id`, the same in every
    evaluation round, in index order."""
    return _words(_name("eval", run_seed, prompt_id), size)


def eval_sample_seed(run_seed: int, prompt_id: str, index: int) -> int:
    """Sample `index` of held-out prompt `prompt_id`: its group's seed `index`."""
    return eval_group_seeds(run_seed, prompt_id, index + 1)[index]


def continuation_seed(seed: int, num_tokens: int) -> int:
    """The seed of a request's continuation after `num_tokens` completion tokens (0: the
    request's own seed)."""
    return seed if num_tokens == 0 else derive_seed("continue", seed, num_tokens)


def uniform(seed: int, position: int) -> float:
    """The `position`-th draw of stream `seed`: a float in [0, 1) on a grid of 2**-24 (exact
    in float32). Counter-based, so a draw needs no state and no other draw."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=4).digest()
    return (int.from_bytes(digest, "little") >> 8) / float(1 << 24)
