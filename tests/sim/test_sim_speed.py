import math

import numpy as np
import pytest

from areal.codec import decode
from areal.messages import Generated
from areal.sim import speed
from areal.sim.speed import REFERENCE_TOKENS, reference_frames


def test_the_reference_is_a_completion_as_a_rollout_worker_sends_it():
    msg = decode(reference_frames())
    assert isinstance(msg, Generated)
    assert len(msg.output_ids) == len(msg.logprobs) == len(msg.versions) == REFERENCE_TOKENS
    assert msg.output_ids.dtype == np.int32 and msg.logprobs.dtype == np.float32
    assert all(type(frame) is bytes for frame in reference_frames())  # as a socket gives them


def test_the_reference_time_is_the_least_timing_per_decode_in_microseconds(monkeypatch):
    # a clock whose timings are 5, 2 and 3 ms: the least (2 ms) over 10 decodes is 200 us
    ticks = iter([0.0, 0.005, 1.0, 1.002, 2.0, 2.003])
    monkeypatch.setattr(speed.time, "perf_counter", lambda: next(ticks))
    assert speed.reference_decode_us(calls=10, repeats=3) == pytest.approx(200.0)


def test_the_reference_time_is_measured_on_the_real_decoder():
    assert 0 < speed.reference_decode_us(calls=20, repeats=2) < math.inf
