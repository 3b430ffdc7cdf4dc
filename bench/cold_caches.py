"""What the controller's work costs when its data and code have left the CPU's caches.

The controller at cluster scale handles tens of thousands of messages a step, each about
other samples, groups and workers: between two Completions it reads little that the last
one left in the caches. So its cost per message (bench/cluster.py's table (r), measured
alone) is several times what the same call costs in a tight loop, where everything it
touches stays cached. This bench measures the factor on the controller's own hot calls:

    hot    the call repeated over a few hundred prepared inputs, nothing else between
    cold   the same, after a pass over a buffer larger than the last-level cache
           (`--sweep-mb`) before each call: its data, the interpreter's and the code's
           own cache lines are then read from memory, as after a burst of other messages

Calls: decoding a Completions of 16 completions of 3,000 tokens (the message a rollout
server answers with), its structure check and its token checks (`Completions.check`,
`checks.completions_fit`), recording it in the ledger (`Ledger.finish_completions`),
encoding the Score of one group of 16, and decoding a bare Heartbeat (the most frequent
message: every worker that sent nothing else in an interval sends one). Each figure is the
median over `--repeats` rounds of the mean per call. The ratio cold/hot says how much a cut that saves instructions on a hot
loop can save in the controller: a call that touches fewer distinct objects gains more.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from areal.codec import decode, encode
from areal.controller.checks import completions_fit
from areal.controller.ledger import Ledger
from areal.messages import Completions, FinishReason, Generated, Heartbeat, Score
from areal.tasks.base import Prompt

from results_page import publish, write_results  # bench/ is on the path when run as a script

COMPLETIONS = 16
TOKENS = 3000
PROMPT_TOKENS = 200
VOCAB = 151_936  # Qwen2's vocabulary


def _completions(group: int, rng: np.random.Generator, request_ids: list[str]) -> Completions:
    completions = []
    for request_id in request_ids:
        length = int(rng.integers(TOKENS // 2, TOKENS * 3 // 2))
        split = length // 3
        completions.append(
            Generated(
                request_id=request_id,
                output_ids=rng.integers(0, VOCAB, length).astype(np.int32),
                logprobs=-rng.random(length).astype(np.float32),
                versions=np.repeat(
                    np.array([group % 5, group % 5 + 1], np.int32), [split, length - split]
                ),
                finish_reason=FinishReason.STOP,
                num_interruptions=1,
                generation_s=20.0,
            )
        )
    return Completions.of(completions)


class Inputs:
    """`count` groups admitted to a ledger and sent for generation, one Completions each
    (encoded too), a Score of each, and a bare Heartbeat's frames a group (copies: each
    call reads its own)."""

    def __init__(self, count: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.ledger = Ledger()
        self.messages: list[Completions] = []
        self.frames: list[list[bytes]] = []
        self.scores: list[Score] = []
        self.heartbeats = [[bytes(frame) for frame in encode(Heartbeat())] for _ in range(count)]
        for g in range(count):
            prompt = Prompt(prompt_id=f"p{g}", text="x", reference="1")
            group = self.ledger.add_group(
                prompt, rng.integers(0, VOCAB, PROMPT_TOKENS).astype(np.int32), COMPLETIONS, 3
            )
            for sample in group.samples:
                self.ledger.pending.popleft()
                self.ledger.start_generation(sample, b"worker", 0.0)
            msg = _completions(g, rng, [s.request_id for s in group.samples])
            self.messages.append(msg)
            self.frames.append([bytes(frame) for frame in encode(msg)])
            self.scores.append(
                Score(
                    request_ids=msg.request_ids,
                    prompt_id=prompt.prompt_id,
                    completion_ids=[c.output_ids for c in msg.completions()],
                    reference=prompt.reference,
                )
            )


def _calls(inputs: Inputs) -> dict[str, Callable[[int], Any]]:
    """Each call, on input i (finish_completions records each message once: it runs last)."""
    return {
        "decode Completions": lambda i: decode(inputs.frames[i]),
        "Completions.check": lambda i: inputs.messages[i].check(),
        "completions_fit": lambda i: completions_fit(
            inputs.messages[i], max_new_tokens=TOKENS * 2, version=10, vocab_size=VOCAB
        ),
        "encode Score": lambda i: encode(inputs.scores[i]),
        "decode Heartbeat": lambda i: decode(inputs.heartbeats[i]),
        "Ledger.finish_completions": lambda i: inputs.ledger.finish_completions(
            inputs.messages[i], b"worker"
        ),
    }


def _from(call: Callable[[int], Any], offset: int) -> Callable[[int], Any]:
    """`call` on input offset + i."""
    return lambda i: call(offset + i)


def _time(call: Callable[[int], Any], count: int, sweep: np.ndarray | None) -> float:
    """Mean CPU seconds a call over inputs 0..count-1; `sweep`: read before each call."""
    spent = 0.0
    for i in range(count):
        if sweep is not None:
            sweep.sum()
        start = time.thread_time()
        call(i)
        spent += time.thread_time() - start
    return spent / count


def measure(count: int, repeats: int, sweep_mb: int) -> list[dict[str, Any]]:
    sweep = np.ones(sweep_mb * (1 << 20) // 8)
    hot: dict[str, list[float]] = {}
    cold: dict[str, list[float]] = {}
    for _ in range(repeats):
        inputs = Inputs(count)
        for name, call in _calls(inputs).items():
            if name == "Ledger.finish_completions":  # once per message: hot and cold apart
                half = count // 2
                hot.setdefault(name, []).append(_time(call, half, None))
                cold.setdefault(name, []).append(_time(_from(call, half), count - half, sweep))
                continue
            _time(call, count, None)  # warm the code
            hot.setdefault(name, []).append(_time(call, count, None))
            cold.setdefault(name, []).append(_time(call, count, sweep))
    return [
        {
            "call": name,
            "hot_us": statistics.median(hot[name]) * 1e6,
            "cold_us": statistics.median(cold[name]) * 1e6,
        }
        for name in hot
    ]


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'call':28s} {'hot us':>8s} {'cold us':>8s} {'cold/hot':>9s}",
        *(
            f"{r['call']:28s} {r['hot_us']:8.1f} {r['cold_us']:8.1f} "
            f"{r['cold_us'] / r['hot_us']:8.1f}x"
            for r in rows
        ),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (not published)")
    parser.add_argument("--messages", type=int, default=400, help="inputs per round")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--sweep-mb", type=int, default=64, help="buffer read before each cold call (MiB)"
    )
    args = parser.parse_args()
    count, repeats = (40, 1) if args.quick else (args.messages, args.repeats)
    rows = measure(count, repeats, args.sweep_mb)
    text = table(rows)
    print(text)
    if publish(args.quick):
        write_results(
            "cold_caches",
            title="The controller's calls with cold caches",
            command="python bench/cold_caches.py",
            table=text,
            data={"rows": rows, "messages": count, "repeats": repeats, "sweep_mb": args.sweep_mb},
            notes=(
                f"Per call, CPU microseconds (thread time), median of {repeats} rounds of "
                f"{count} inputs: a Completions of {COMPLETIONS} completions of about "
                f"{TOKENS} tokens, a Score of one group of {COMPLETIONS}. hot: repeated with "
                f"nothing between; cold: after reading {args.sweep_mb} MiB (more than the "
                "last-level cache) before each call. Table (r)'s replay, where a controller "
                "handles every message of a 2,048-accelerator run, pays close to the cold "
                'figures (docs/history.md, "Cold caches").'
            ),
        )


if __name__ == "__main__":
    main()
