"""What the controller's intake thread saves its event loop, by message size.

    python bench/intake.py [--quick] [--repeats R]

The controller decodes each Completions, checks that its parts fit together
(`Completions.check`) and reads every token id and log-prob of it once, to find their
extremes (controller/checks.py, `intake_reading`). Its intake (areal/intake.py) does all
three on a thread beside the event loop, given the message's frames; handing them over and
taking the message back costs the loop's thread CPU of its own. This bench measures, per
message and in the loop thread's CPU time (`time.thread_time`), for Completions of 16
completions and a range of total tokens, received as frames:

    loop      the loop does that work itself (controller.intake_thread=false, or a
              message below checks.INTAKE_MIN_BYTES)
    waited    handed to the intake and waited for at once: the loop idle when it arrived
              (and what the simulation charges, sim/channel.py)
    ahead     READ_AHEAD messages handed over together, then each waited for: the channel
              reading ahead a backlog (areal/transport.py)

and the intake thread's own CPU per message. Each round walks enough distinct messages
(about 256 MB of tokens) that their arrays come from memory, not the caches, as a
controller's do at cluster scale; each figure is the median of `--repeats` rounds. The
ratios are against `loop`: below 1 the intake saves the loop's thread time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np

from areal.codec import encode
from areal.controller.checks import INTAKE_MIN_BYTES, intake_reading
from areal.intake import Intake
from areal.messages import DEFAULT_MAX_BYTES, Completions, FinishReason, Generated
from areal.transport import READ_AHEAD

from results_page import publish, write_results  # bench/ is on the path when run as a script

COMPLETIONS = 16
VOCAB = 151_936  # Qwen2's vocabulary
SIZES = (4_096, 16_384, 32_768, 65_536, 131_072)
QUICK_SIZES = (4_096, 65_536)
COLD_BYTES = 256 << 20
"""Token bytes walked a round: beyond the last-level cache of the machines measured."""


def _frames(tokens: int, rng: np.random.Generator) -> list[Any]:
    """A Completions of `tokens` tokens as the controller's channel receives it: its frames
    after the identity."""
    length = tokens // COMPLETIONS
    return encode(
        Completions.of(
            [
                Generated(
                    request_id=f"g0-s{i}-a0",
                    output_ids=rng.integers(0, VOCAB, length).astype(np.int32),
                    logprobs=-rng.random(length).astype(np.float32),
                    versions=np.ones(length, np.int32),
                    finish_reason=FinishReason.STOP,
                )
                for i in range(COMPLETIONS)
            ]
        )
    )


_READ = intake_reading(DEFAULT_MAX_BYTES)


def _per_message_us(run, messages: list[list[Any]]) -> float:
    start = time.thread_time()
    run(messages)
    return (time.thread_time() - start) / len(messages) * 1e6


def _on_loop(messages: list[list[Any]]) -> None:
    for body in messages:
        _READ(body)


def _waited(intake: Intake):
    def run(messages: list[list[Any]]) -> None:
        for body in messages:
            intake.submit(body).result()

    return run


def _ahead(intake: Intake):
    def run(messages: list[list[Any]]) -> None:
        for first in range(0, len(messages), READ_AHEAD):
            for done in [intake.submit(body) for body in messages[first : first + READ_AHEAD]]:
                done.result()

    return run


def measure(tokens: int, repeats: int, rng: np.random.Generator) -> dict[str, float]:
    count = max(READ_AHEAD, COLD_BYTES // (8 * tokens))
    messages = [_frames(tokens, rng) for _ in range(count)]
    intake = Intake(_READ, lambda body: True)
    try:
        rounds: dict[str, list[float]] = {"loop": [], "waited": [], "ahead": [], "thread": []}
        for _ in range(repeats):
            rounds["loop"].append(_per_message_us(_on_loop, messages))
            rounds["waited"].append(_per_message_us(_waited(intake), messages))
            before = intake.cpu_s
            rounds["ahead"].append(_per_message_us(_ahead(intake), messages))
            rounds["thread"].append((intake.cpu_s - before) / len(messages) * 1e6)
    finally:
        intake.close()
    return {name: statistics.median(values) for name, values in rounds.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two sizes, two rounds")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sizes = QUICK_SIZES if args.quick else SIZES
    repeats = 2 if args.quick else args.repeats
    rng = np.random.default_rng(0)
    rows, data = [], []
    for tokens in sizes:
        r = measure(tokens, repeats, rng)
        data.append({"tokens": tokens, **r})
        rows.append(
            f"{tokens:>8,} {r['loop']:>8.1f} {r['waited']:>8.1f} {r['ahead']:>8.1f} "
            f"{r['waited'] / r['loop']:>7.2f} {r['ahead'] / r['loop']:>7.2f} {r['thread']:>9.1f}"
        )
        print(rows[-1], file=sys.stderr)
    header = (
        f"{'tokens':>8} {'loop us':>8} {'waited':>8} {'ahead':>8} {'w/loop':>7} "
        f"{'a/loop':>7} {'thread us':>9}"
    )
    table = "\n".join([header, "-" * len(header), *rows]) + (
        f"\n(per Completions of {COMPLETIONS} completions: the event loop thread's CPU "
        "microseconds to decode it, check its parts and read its tokens' extremes itself "
        "(loop), to hand it to the intake "
        f"and wait at once (waited), or in runs of {READ_AHEAD} (ahead); the intake "
        f"thread's own CPU (thread); medians of {repeats} rounds over about "
        f"{COLD_BYTES >> 20} MB of tokens each; the intake takes messages of "
        f"{INTAKE_MIN_BYTES // 8:,} tokens or more: {INTAKE_MIN_BYTES:,} bytes of arrays)"
    )
    print(table)
    if publish(args.quick):
        write_results(
            "intake",
            title="The intake thread: the event loop's CPU per Completions",
            command=" ".join(["python", *sys.argv]),
            table=table,
            data=data,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
