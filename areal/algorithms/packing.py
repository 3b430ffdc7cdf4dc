"""Token-budgeted micro-batches and token-balanced data-parallel partitions of sequences.

Role: the trainer packs variable-length sequences without padding. Before a step it splits
the batch across data-parallel ranks (`partition_balanced`, equal token counts so no rank
waits for another), and each rank splits its share into micro-batches that fit a token
budget (`allocate_micro_batches`). Both work on sequence lengths only and return lists of
indices into `lengths`; `PackedBatch.select` turns them into batches.

Contract (tested as properties):
- every index appears exactly once; no bin or part is empty, except the parts that
  `partition_balanced` cannot fill when there are fewer sequences than parts;
- a micro-batch holds at most `max_tokens` tokens, except a sequence longer than the budget,
  which gets a micro-batch of its own;
- balance: max load - min load <= the longest sequence involved (over micro-batches
  without an over-long sequence, and over the parts of a partition);
- the output depends only on the inputs (ties broken by index), and indices inside a bin
  are ascending, so packed order follows batch order.

It does not look at tokens, pad, or cut sequences; it does not know about ranks or devices.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Sequence


def first_fit_decreasing(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Bins of indices from first-fit-decreasing; over-long sequences get their own bin.

    FFD is the classic near-optimal packer (at most 11/9 OPT + 6/9 bins); it fixes how many
    micro-batches are needed, and `allocate_micro_batches` then balances them.
    """
    lengths = _check_lengths(lengths)
    _check_positive("max_tokens", max_tokens)
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in _decreasing(lengths):
        length = lengths[index]
        # An over-long sequence's bin is marked full so that nothing joins it.
        fill = length if length <= max_tokens else max_tokens + 1
        for b, load in enumerate(loads):
            if load + length <= max_tokens:
                bins[b].append(index)
                loads[b] += fill
                break
        else:
            bins.append([index])
            loads.append(fill)
    return [sorted(b) for b in bins]


def allocate_micro_batches(
    lengths: Sequence[int], max_tokens: int, min_bins: int = 1
) -> list[list[int]]:
    """Micro-batches (lists of indices) under a `max_tokens` budget, balanced by tokens.

    The number of bins starts at max(FFD's count, min_bins) and the sequences are placed
    longest first, each into the least-loaded bin (the least-loaded fits if any does). If
    a sequence fits nowhere, the fill is redone with one more bin, so the final fill never
    overflows and keeps the greedy balance bound (max - min load <= longest sequence).
    Over-long sequences come first, one per bin, and count towards `min_bins`. Bins are
    never empty, so fewer than `min_bins` come back when there are fewer sequences.
    """
    lengths = _check_lengths(lengths)
    _check_positive("max_tokens", max_tokens)
    _check_positive("min_bins", min_bins)
    over = [i for i in _decreasing(lengths) if lengths[i] > max_tokens]
    normal = [i for i in _decreasing(lengths) if lengths[i] <= max_tokens]
    num_ffd = len(first_fit_decreasing([lengths[i] for i in normal], max_tokens))
    num_bins = max(num_ffd, min(min_bins - len(over), len(normal)))
    while True:
        # Terminates: with one bin per sequence every sequence fits.
        bins = _balanced_fill(normal, lengths, num_bins, max_tokens)
        if bins is not None:
            return [[i] for i in over] + bins
        num_bins += 1


def partition_balanced(lengths: Sequence[int], num_parts: int) -> list[list[int]]:
    """`num_parts` lists of indices with near-equal token totals (greedy longest-first).

    Each sequence, longest first, goes to the part with the fewest tokens (then the fewest
    sequences, then the lowest index), which guarantees max - min total <= the longest
    sequence and a non-empty part for every rank when len(lengths) >= num_parts. With fewer
    sequences than parts, the first len(lengths) parts get one sequence each and the rest
    are empty: the caller must decide what an idle rank does (it still has to join the
    step's collectives).
    """
    lengths = _check_lengths(lengths)
    _check_positive("num_parts", num_parts)
    parts = _balanced_fill(_decreasing(lengths), lengths, num_parts, max_tokens=None)
    assert parts is not None  # without a budget every sequence fits
    return parts


def _balanced_fill(
    order: list[int], lengths: list[int], num_bins: int, max_tokens: int | None
) -> list[list[int]] | None:
    """Place `order` (longest first) into the least-loaded of `num_bins` bins; None if one
    does not fit under `max_tokens`.

    Ties go to the bin with fewer sequences, so zero-length sequences cannot leave a bin
    empty, then to the lower index, for determinism. Why the bound holds: when the heaviest
    bin got its last sequence x it was the least loaded, and loads only grow, so at the end
    min load >= max load - x.
    """
    heap = [(0, 0, b) for b in range(num_bins)]  # (tokens, sequences, bin)
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for index in order:
        load, count, b = heapq.heappop(heap)
        if max_tokens is not None and load + lengths[index] > max_tokens:
            return None  # the least-loaded bin does not fit, so none does
        bins[b].append(index)
        heapq.heappush(heap, (load + lengths[index], count + 1, b))
    return [sorted(b) for b in bins]


def _decreasing(lengths: list[int]) -> list[int]:
    """Indices by decreasing length, ties by increasing index (a deterministic order)."""
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    values = [int(length) for length in lengths]
    bad = [(i, lengths[i]) for i, v in enumerate(values) if v < 0 or v != lengths[i]]
    if bad:
        raise ValueError(
            f"sequence lengths must be non-negative integers; got {bad[:5]} (index, value)"
        )
    return values


def _check_positive(name: str, value: int) -> None:
    try:
        ok = operator.index(value) >= 1
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{name}={value!r} must be a positive int")
