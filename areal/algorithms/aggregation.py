"""Sequence boundaries inside the loss, and how per-token terms become one loss.

Role: the decoupled PPO loss sees a packed [N] batch; its sequence-level options (a
sequence-level importance weight, GSPO's sequence ratio, the sequence-mean aggregations)
need to know which loss token belongs to which sequence. `Segments` holds that, built from
`cu_seqlens` and the loss mask: only loss-masked tokens are members of a sequence, so
prompt tokens and an episode's observation tokens (loss mask 0) never enter a sequence
mean.

Loss aggregation (`LOSS_AGG_MODES`, named as verl's `loss_agg_mode`), over the terms l_t of
the loss tokens of a global batch (all micro-batches and data-parallel ranks of one
optimiser step) of sequences s with n_s loss tokens each:

    token-mean               sum_t l_t / sum_s n_s                  (DAPO's token-level loss;
                                                                     the paper's decoupled PPO)
    seq-mean-token-mean      (1/S) sum_s (1/n_s) sum_{t in s} l_t   (GRPO, arXiv 2402.03300)
    seq-mean-token-sum-norm  (1/S) sum_s (1/L) sum_{t in s} l_t     (Dr.GRPO, arXiv 2503.20783:
                                                                     a constant L, not n_s)

S counts the sequences with at least one loss token (a sequence whose tokens are all
masked, e.g. a truncated completion under `mask_truncated`, has no token mean). Every mode
is written as  loss = sum_t a_t l_t / U  with a per-token factor a_t (1, 1/n_s or 1/L)
that depends on the token's own sequence only, and a global count U of "units" (loss
tokens, or sequences). A sequence is never cut across micro-batches or ranks, so a_t is
local and summing the pieces' losses, each divided by the global U, gives the loss of the
whole batch exactly.

Pure tensor code: no config, no processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class Segments:
    """Which sequence each of the L loss tokens belongs to."""

    index: torch.Tensor
    """[L] int64: the sequence (0..S-1, in packing order) of each loss token."""
    num_seqs: int
    """S: sequences of the packed batch, including those without loss tokens."""

    @classmethod
    def of_loss_tokens(cls, cu_seqlens: torch.Tensor, loss_mask: torch.Tensor) -> Segments:
        """From [S+1] packed offsets and the [N] bool loss mask."""
        if (
            cu_seqlens.dim() != 1
            or len(cu_seqlens) < 1
            or int(cu_seqlens[0]) != 0
            or int(cu_seqlens[-1]) != len(loss_mask)
        ):
            raise ValueError(
                f"cu_seqlens {cu_seqlens.tolist()} must start at 0 and end at the "
                f"{len(loss_mask)} tokens of the batch"
            )
        seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        if bool((seqlens < 0).any()):
            raise ValueError(f"cu_seqlens must not decrease, got {cu_seqlens.tolist()}")
        num_seqs = len(seqlens)
        seq_of_token = torch.repeat_interleave(
            torch.arange(num_seqs, device=loss_mask.device),
            seqlens.to(loss_mask.device),
            output_size=len(loss_mask),
        )
        return cls(index=seq_of_token[loss_mask], num_seqs=num_seqs)

    def sizes(self) -> torch.Tensor:
        """[S] loss tokens of each sequence (0 for a sequence without any)."""
        return torch.bincount(self.index, minlength=self.num_seqs)

    def num_nonempty(self) -> int:
        """Sequences with at least one loss token."""
        return int((self.sizes() > 0).sum())

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """[L] the mean of `values` [L] over each token's own sequence (differentiable)."""
        sums = values.new_zeros(self.num_seqs).index_add(0, self.index, values)
        sizes = self.sizes().clamp(min=1).to(values.dtype)
        return (sums / sizes)[self.index]


def needs_segments(loss_agg_mode: str) -> bool:
    return loss_agg_mode != "token-mean"


def aggregation_factors(
    segments: Segments | None,
    mode: str,
    num_tokens: int,
    norm_tokens: float | None,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """[L] per-token factor a_t of `mode`; None for token-mean (a_t = 1, nothing to multiply)."""
    if mode == "token-mean":
        return None
    assert segments is not None
    if mode == "seq-mean-token-mean":
        return 1.0 / segments.sizes()[segments.index].to(dtype)
    assert norm_tokens is not None  # check_aggregation refused it at config time
    return torch.full(
        (num_tokens,), 1.0 / float(norm_tokens), dtype=dtype, device=segments.index.device
    )


def num_units(segments: Segments | None, mode: str, num_tokens: int) -> int:
    """U of this piece: its loss tokens (token-mean) or its sequences with loss tokens."""
    if mode == "token-mean":
        return num_tokens
    assert segments is not None
    return segments.num_nonempty()


def check_aggregation(mode: str, norm_tokens: float | None) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={mode!r} is not one of {', '.join(LOSS_AGG_MODES)}")
    if mode == "seq-mean-token-sum-norm" and not (norm_tokens is not None and norm_tokens > 0):
        raise ValueError(
            f"loss_agg_mode='seq-mean-token-sum-norm' needs loss_agg_norm > 0 (the "
            f"constant token count L of Dr.GRPO), got {norm_tokens!r}"
        )
