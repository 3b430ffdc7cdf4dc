"""Per-token log-probs (and entropy) of padding-free packed sequences under a causal LM.

Contract: for a pack of S sequences, N tokens in all (`token_ids [N]`, `cu_seqlens [S+1]`),
entry t of the result is log p(token_t | earlier tokens of the same sequence) under
softmax(logits / temperature), in float32, and 0 at the first token of every sequence
(nothing predicts it). This is the alignment of `areal.types.PackedBatch`: value t
describes token t itself. Works with and without autograd; the trainer backpropagates
through it.

Sequences do not see each other. The pack is one row `[1, N]` whose `position_ids` restart
at 0 at every sequence start, run with `use_cache=False` and no attention mask. transformers
5.x (`masking_utils._preprocess_mask_arguments` -> `find_packed_sequence_indices`) then
reads each drop in position as a sequence boundary and ands a block-diagonal mask into the
causal one for sdpa / eager / flex; the flash kernels get explicit `cu_seq_lens_*`. The
detection is skipped whenever a cache object exists, and models default to
`use_cache=True` (the config value), which creates one: without `use_cache=False` packed
sequences silently attend across boundaries.

Memory: the fp32 log-softmax is never built over the whole pack. Rows are processed in
chunks of C tokens (by default C*V*4 bytes <= 256 MiB for vocabulary V): per chunk,
logits -> fp32 -> / temperature -> logsumexp and a gather. Peak extra memory is a few
[C, V] fp32 buffers. For model types whose head is a plain linear layer
(_PLAIN_HEAD_MODEL_TYPES) the head itself is applied per chunk to the final hidden states,
so no [N, V] tensor exists at all (`chunk_head=False` turns this off); other models run
their own forward (their [N, V] logits in model dtype exist, e.g. Gemma's soft-capping
stays theirs) and only the log-softmax is chunked. Under autograd each chunk is
checkpointed: backward keeps only the chunk's input and recomputes its logits (for the
hidden-state path: one extra lm_head matmul per step).

Not here: losses, loss masks, padding-based batching, sampling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from areal.models.hf import PACKING_ATTN_IMPLEMENTATIONS

_PLAIN_HEAD_MODEL_TYPES = frozenset(
    {"qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "llama", "mistral", "gpt2"}
)
"""Model types whose CausalLM forward is exactly `lm_head(base_model(...).last_hidden_state)`.

Checked by reading their transformers 5.19 modelling code; models that scale or soft-cap
logits after the head (Gemma, Cohere, Granite, ...) are not listed and use their own forward.
"""

_CHUNK_BYTES = 1 << 28
"""Default budget for one fp32 [C, V] chunk of logits (256 MiB)."""


def packed_logprobs(
    model: PreTrainedModel,
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    chunk_head: bool | None = None,
) -> torch.Tensor:
    """[N] float32 log-probs of each token given its sequence prefix; 0 at sequence starts.

    token_ids: [N] integer token ids of S sequences laid end to end.
    cu_seqlens: [S+1] cumulative lengths, cu_seqlens[0] = 0, cu_seqlens[-1] = N.
    chunk_size: tokens per log-softmax chunk; None sizes chunks to ~256 MiB of fp32 logits.
    chunk_head: None applies lm_head per chunk to the hidden states where the model type
        allows it (_PLAIN_HEAD_MODEL_TYPES), else runs the model's own forward. False always
        runs `model(...)`: needed when hooks on the root module's forward must fire (the
        chunked path calls `model.base_model` and the head directly). True insists on it.
    """
    logprobs, _ = _packed_stats(
        model, token_ids, cu_seqlens, temperature, chunk_size, chunk_head, with_entropy=False
    )
    return logprobs


def packed_logprobs_and_entropy(
    model: PreTrainedModel,
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    chunk_head: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] log-probs, [N] entropy in nats), both float32 and 0 at sequence starts.

    entropy[t] is the entropy of softmax(logits / temperature) at the position that predicts
    token t, i.e. aligned like the log-probs, so the same loss mask applies to both.
    Arguments as for `packed_logprobs`.
    """
    logprobs, entropy = _packed_stats(
        model, token_ids, cu_seqlens, temperature, chunk_size, chunk_head, with_entropy=True
    )
    assert entropy is not None
    return logprobs, entropy


def reference_logprobs_and_entropy(
    model: PreTrainedModel,
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive reference for tests: one unpadded forward per sequence, full fp32 log-softmax.

    Same alignment and outputs as `packed_logprobs_and_entropy`, differentiable, slow.
    """
    token_ids, cu_seqlens = _check_pack(token_ids, cu_seqlens)
    _check_temperature(temperature)
    device = model.device
    logprob_parts, entropy_parts = [], []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end == start:
            continue
        seq = token_ids[start:end].to(device)
        logits = model(input_ids=seq[None], use_cache=False).logits[0, :-1].float() / temperature
        log_softmax = torch.log_softmax(logits, dim=-1)
        first = torch.zeros(1, device=device)
        logprob_parts += [first, log_softmax.gather(-1, seq[1:, None]).squeeze(-1)]
        entropy_parts += [first, -(log_softmax.exp() * log_softmax).sum(-1)]
    if not logprob_parts:
        empty = torch.zeros(0, device=device)
        return empty, empty.clone()
    return torch.cat(logprob_parts), torch.cat(entropy_parts)


def packed_position_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[N] int64 position of each token within its own sequence (restarts at 0)."""
    cu = cu_seqlens.long()
    seqlens = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], seqlens)
    return torch.arange(int(cu[-1]), device=cu.device) - starts


def _packed_stats(
    model: PreTrainedModel,
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    temperature: float,
    chunk_size: int | None,
    chunk_head: bool | None,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    token_ids, cu_seqlens = _check_pack(token_ids, cu_seqlens)
    _check_temperature(temperature)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1 (or None for automatic)")
    device, num_tokens = model.device, len(token_ids)
    if num_tokens == 0:
        empty = torch.zeros(0, device=device)
        return empty, (empty.clone() if with_entropy else None)
    token_ids = token_ids.to(device)
    features, head = _packed_features(model, token_ids, cu_seqlens, chunk_head)
    # Row t predicts token t + 1. Slices are views: no copy of the [N, H] or [N, V] features.
    # The S - 1 rows that "predict" the next sequence's first token are computed and dropped.
    rows, targets = features[:-1], token_ids[1:]
    if chunk_size is None:
        vocab_size = model.get_output_embeddings().weight.shape[0]
        chunk_size = max(1, _CHUNK_BYTES // (4 * vocab_size))
    # Checkpointing keeps backward from holding every chunk's [C, V] fp32 logits.
    use_checkpoint = torch.is_grad_enabled() and rows.requires_grad
    stats = []
    for begin in range(0, len(rows), chunk_size):
        args = (
            rows[begin : begin + chunk_size],
            targets[begin : begin + chunk_size],
            head,
            temperature,
            with_entropy,
        )
        stats.append(
            checkpoint(_chunk_stats, *args, use_reentrant=False)
            if use_checkpoint
            else _chunk_stats(*args)
        )
    is_start = torch.zeros(num_tokens, dtype=torch.bool)
    is_start[cu_seqlens[:-1][cu_seqlens[:-1] < num_tokens]] = True
    is_start = is_start.to(device)
    logprobs = _align([s[0] for s in stats], is_start)
    return logprobs, (_align([s[1] for s in stats], is_start) if with_entropy else None)


def _packed_features(
    model: PreTrainedModel,
    token_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_head: bool | None,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """One forward over the pack: ([N, H] hidden states, lm_head) or ([N, V] logits, identity)."""
    impl = model.config._attn_implementation
    if impl not in PACKING_ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"model attention implementation {impl!r} does not keep packed sequences apart; "
            f"load the model with attn_implementation in {', '.join(PACKING_ATTN_IMPLEMENTATIONS)}"
        )
    plain_head = model.config.model_type in _PLAIN_HEAD_MODEL_TYPES
    if chunk_head and not plain_head:
        raise ValueError(
            f"chunk_head=True, but model_type={model.config.model_type!r} may transform logits "
            f"after its lm_head; only {', '.join(sorted(_PLAIN_HEAD_MODEL_TYPES))} are known "
            "not to; pass chunk_head=None"
        )
    device = token_ids.device
    kwargs: dict = {
        "input_ids": token_ids[None],
        "position_ids": packed_position_ids(cu_seqlens).to(device)[None],
        "use_cache": False,  # a cache disables transformers' packed-sequence masking
    }
    if impl.startswith("flash_attention"):
        cu = cu_seqlens.to(device=device, dtype=torch.int32)
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        kwargs.update(
            cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len
        )
    if plain_head and chunk_head is not False:
        hidden = model.base_model(**kwargs).last_hidden_state[0]
        return hidden, model.get_output_embeddings()
    return model(**kwargs).logits[0], _identity


def _chunk_stats(
    rows: torch.Tensor,
    targets: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target and (optionally) the entropy, for one chunk of [C] rows."""
    logits = head(rows).float()
    if temperature != 1.0:
        logits = logits / temperature
    log_normaliser = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - log_normaliser
    if not with_entropy:
        return logprobs, logprobs.new_zeros(())
    # H = logsumexp(z) - sum softmax(z) * z
    entropy = log_normaliser - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logprobs, entropy


def _align(next_parts: list[torch.Tensor], is_start: torch.Tensor) -> torch.Tensor:
    """[N] values for token t from the [N-1] values computed at row t - 1; 0 at starts."""
    first = torch.zeros(1, dtype=torch.float32, device=is_start.device)
    values = torch.cat([first, *next_parts])
    return torch.where(is_start, 0.0, values)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _check_pack(
    token_ids: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate shapes and boundaries; return (token_ids int64, cu_seqlens int64 on CPU)."""
    if token_ids.ndim != 1:
        raise ValueError(f"token_ids must be 1-D [N], got shape {tuple(token_ids.shape)}")
    if token_ids.is_floating_point() or token_ids.is_complex():
        raise ValueError(f"token_ids must be integers, got {token_ids.dtype}")
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if cu.ndim != 1 or len(cu) < 1:
        raise ValueError(f"cu_seqlens must be 1-D [S+1], got shape {tuple(cu_seqlens.shape)}")
    if cu[0] != 0 or cu[-1] != len(token_ids):
        raise ValueError(
            f"cu_seqlens must start at 0 and end at N={len(token_ids)}, got "
            f"{int(cu[0])}..{int(cu[-1])}"
        )
    if (cu[1:] < cu[:-1]).any():
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
    return token_ids.long(), cu


def _check_temperature(temperature: float) -> None:
    if not 0 < temperature < float("inf"):
        raise ValueError(f"temperature={temperature!r} must be a positive finite number")
