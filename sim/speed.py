"""How fast this machine runs the controller's kind of work, now: a yardstick for its CPU cost.

The controller's CPU seconds per simulated step (bench/cluster.py, tables f and r) are real
seconds on whatever core the simulation got, and on a shared machine the same code measures
slower one hour than another. A share of the step time
alone cannot tell a slower controller from a slower machine. So each measured simulation
first times a fixed piece of the controller's own hot path, the decoding of one completion
of 3,000 tokens as a rollout worker sends it (`reference_decode_us`), and reports it beside
its CPU time: two runs compare by their ratio of CPU time to this yardstick.
"""

from __future__ import annotations

import time

import numpy as np

from areal.codec import decode, encode
from areal.messages import FinishReason, Generated

REFERENCE_TOKENS = 3000
"""About the mean completion of the simulated workload (sim/costs.yaml: median 4,000 tokens,
most far shorter), and the message the controller receives most (one per sample)."""
_CALLS, _REPEATS = 2000, 7


def reference_frames(num_tokens: int = REFERENCE_TOKENS) -> list[bytes]:
    """The frames of a fixed Generated, as bytes (as a socket hands them over)."""
    msg = Generated(
        request_id="g1234-5",
        output_ids=np.arange(num_tokens, dtype=np.int32),
        logprobs=np.full(num_tokens, -0.5, np.float32),
        versions=np.zeros(num_tokens, np.int32),
        finish_reason=FinishReason.STOP,
    )
    return [bytes(frame) for frame in encode(msg)]


def reference_decode_us(calls: int = _CALLS, repeats: int = _REPEATS) -> float:
    """Microseconds per decode of `reference_frames()` by the codec's Python path (what
    every decode did before its compiled path existed: the yardstick stays the same work):
    the least over `repeats` timings of `calls` decodes each (the least is the machine's
    speed, the rest is its noise)."""
    frames = reference_frames()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            decode(frames, compiled=False)
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6
