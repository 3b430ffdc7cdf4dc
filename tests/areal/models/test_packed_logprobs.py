"""Packed log-probs equal per-sequence log-probs: values, entropy, gradients, no leakage."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from areal.models.hf import load_model
from areal.models.logprobs import (
    packed_logprobs,
    packed_logprobs_and_entropy,
    packed_position_ids,
    reference_logprobs_and_entropy,
)

LENGTHS = (1, 7, 3, 0, 1, 12, 5, 1)
"""Unequal lengths with single-token sequences (including first and last) and an empty one."""

ARCHITECTURES = ("qwen2", "llama", "gpt2", "gemma2")
ATOL = 1e-5


def _pack(
    lengths: tuple[int, ...], vocab_size: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    token_ids = torch.randint(0, vocab_size, (int(cu_seqlens[-1]),), generator=generator)
    return token_ids, cu_seqlens


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_packed_logprobs_and_entropy_equal_per_sequence_forward(
    shared_model, assert_close, name: str, attn: str, temperature: float
) -> None:
    model = shared_model(name, attn)
    token_ids, cu_seqlens = _pack(LENGTHS, model.config.vocab_size)
    with torch.no_grad():
        logprobs, entropy = packed_logprobs_and_entropy(
            model, token_ids, cu_seqlens, temperature=temperature
        )
        ref_logprobs, ref_entropy = reference_logprobs_and_entropy(
            model, token_ids, cu_seqlens, temperature=temperature
        )
        only_logprobs = packed_logprobs(model, token_ids, cu_seqlens, temperature=temperature)
    assert logprobs.dtype == entropy.dtype == torch.float32
    assert_close(logprobs, ref_logprobs, atol=ATOL, what=f"{name}/{attn} log-probs")
    assert_close(entropy, ref_entropy, atol=ATOL, what=f"{name}/{attn} entropy")
    assert_close(only_logprobs, logprobs, what="packed_logprobs vs packed_logprobs_and_entropy")
    starts = cu_seqlens[:-1][cu_seqlens[:-1] < len(token_ids)].long()
    assert bool((logprobs[starts] == 0).all() and (entropy[starts] == 0).all())
    rest = torch.ones(len(token_ids), dtype=torch.bool)
    rest[starts] = False
    assert bool((logprobs[rest] < 0).all() and (entropy[rest] > 0).all())


def test_temperature_changes_the_distribution(shared_model) -> None:
    """Guards the temperature tests: at T=0.7 the values really differ from T=1."""
    model = shared_model("qwen2")
    token_ids, cu_seqlens = _pack(LENGTHS, model.config.vocab_size)
    with torch.no_grad():
        cold = packed_logprobs(model, token_ids, cu_seqlens, temperature=0.7)
        plain = packed_logprobs(model, token_ids, cu_seqlens)
    assert (cold - plain).abs().max() > 1e-2


@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_chunked_log_softmax_matches_one_chunk(shared_model, assert_close, chunk_size: int) -> None:
    model = shared_model("llama")
    token_ids, cu_seqlens = _pack(LENGTHS, model.config.vocab_size)
    with torch.no_grad():
        chunked = packed_logprobs_and_entropy(model, token_ids, cu_seqlens, chunk_size=chunk_size)
        whole = packed_logprobs_and_entropy(model, token_ids, cu_seqlens, chunk_size=10**6)
    assert_close(chunked[0], whole[0], atol=1e-6, what=f"log-probs, chunk_size={chunk_size}")
    assert_close(chunked[1], whole[1], atol=1e-6, what=f"entropy, chunk_size={chunk_size}")


@pytest.mark.parametrize("name", ["qwen2", "gpt2"])
def test_head_runs_on_chunks_of_hidden_states_only(shared_model, assert_close, name: str) -> None:
    """The [N, V] logits never exist: lm_head only ever sees <= chunk_size rows; and the
    model's own forward (chunk_head=False) gives the same values."""
    model = shared_model(name)
    token_ids, cu_seqlens = _pack(LENGTHS, model.config.vocab_size)
    rows_seen: list[int] = []
    handle = model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: rows_seen.append(args[0].shape[-2])
    )
    try:
        with torch.no_grad():
            chunked = packed_logprobs(model, token_ids, cu_seqlens, chunk_size=4)
    finally:
        handle.remove()
    assert rows_seen and max(rows_seen) <= 4 and sum(rows_seen) == len(token_ids) - 1
    with torch.no_grad():
        own = packed_logprobs(model, token_ids, cu_seqlens, chunk_head=False)
    assert_close(chunked, own, atol=1e-6, what=f"{name} chunked head vs own forward")


def test_chunk_head_is_refused_where_logits_are_post_processed(shared_model) -> None:
    with pytest.raises(ValueError, match=r"model_type='gemma2' may transform logits"):
        packed_logprobs(
            shared_model("gemma2"),
            torch.zeros(3, dtype=torch.long),
            torch.tensor([0, 3]),
            chunk_head=True,
        )


@pytest.mark.parametrize("chunk_size", [None, 4])
@pytest.mark.parametrize("name", ["qwen2", "llama", "gemma2"])
def test_gradient_through_packed_equals_per_sequence(
    shared_model, assert_close, name: str, chunk_size: int | None
) -> None:
    """d(sum_t w_t * (logprob_t + 0.1 * entropy_t)) / d(params), packed vs one sequence at a
    time. chunk_size=4 runs several checkpointed chunks through backward."""
    model = shared_model(name)
    token_ids, cu_seqlens = _pack(LENGTHS, model.config.vocab_size)
    weights = torch.rand(len(token_ids), generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters() if p.requires_grad]
    logprobs, entropy = packed_logprobs_and_entropy(
        model, token_ids, cu_seqlens, temperature=0.8, chunk_size=chunk_size
    )
    packed = torch.autograd.grad((weights * (logprobs + 0.1 * entropy)).sum(), params)
    ref_lp, ref_ent = reference_logprobs_and_entropy(model, token_ids, cu_seqlens, temperature=0.8)
    reference = torch.autograd.grad((weights * (ref_lp + 0.1 * ref_ent)).sum(), params)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for param_name, got, want in zip(names, packed, reference, strict=True):
        assert_close(got, want, atol=ATOL, what=f"{name} grad of {param_name}")
    assert any(g.abs().max() > 1e-3 for g in packed), "gradients vanished"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_changing_one_sequence_leaves_the_others_unchanged(
    shared_model, assert_close, name: str, attn: str
) -> None:
    model = shared_model(name, attn)
    token_ids, cu_seqlens = _pack((6, 9, 8), model.config.vocab_size)
    changed = token_ids.clone()
    changed[6:15] = (changed[6:15] + 1) % model.config.vocab_size  # all of sequence B
    with torch.no_grad():
        before = packed_logprobs(model, token_ids, cu_seqlens)
        after = packed_logprobs(model, changed, cu_seqlens)
    assert_close(after[:6], before[:6], atol=1e-6, what=f"{name}/{attn} sequence A")
    assert_close(after[15:], before[15:], atol=1e-6, what=f"{name}/{attn} sequence C")
    assert (after[6:15] - before[6:15]).abs().max() > 1e-3, "sequence B should change"


def test_default_forward_leaks_across_packed_sequences(shared_model) -> None:
    """Why `use_cache=False` is passed: with the config's default cache, transformers 5.19
    skips packed-sequence detection, and the leakage test above would catch that."""
    model = shared_model("qwen2")
    token_ids, cu_seqlens = _pack((6, 9), model.config.vocab_size)
    changed = token_ids.clone()
    changed[:6] = (changed[:6] + 1) % model.config.vocab_size
    position_ids = packed_position_ids(cu_seqlens)[None]
    with torch.no_grad():
        before = model(input_ids=token_ids[None], position_ids=position_ids).logits[0, 6:]
        after = model(input_ids=changed[None], position_ids=position_ids).logits[0, 6:]
    assert (after - before).abs().max() > 1e-3


def test_bfloat16_model_is_close_to_float32(model_dirs, shared_model, assert_close) -> None:
    token_ids, cu_seqlens = _pack(LENGTHS, 100)
    with torch.no_grad():
        low = packed_logprobs(
            load_model(model_dirs["qwen2"], dtype="bfloat16"), token_ids, cu_seqlens
        )
        full = packed_logprobs(shared_model("qwen2"), token_ids, cu_seqlens)
    assert low.dtype == torch.float32
    assert_close(low, full, atol=0.1, what="bf16 vs fp32 log-probs")


def test_position_ids_restart_at_every_sequence() -> None:
    cu_seqlens = torch.tensor([0, 1, 4, 4, 6])
    assert packed_position_ids(cu_seqlens).tolist() == [0, 0, 1, 2, 0, 1]


def test_empty_pack_gives_empty_result(shared_model) -> None:
    model = shared_model("qwen2")
    empty = packed_logprobs(model, torch.zeros(0, dtype=torch.long), torch.tensor([0]))
    assert empty.shape == (0,)


@pytest.mark.parametrize(
    ("cu_seqlens", "message"),
    [
        ([0, 3, 5], r"end at N=6, got 0\.\.5"),
        ([1, 3, 6], r"start at 0"),
        ([0, 4, 3, 6], r"non-decreasing, got \[0, 4, 3, 6\]"),
    ],
)
def test_bad_cu_seqlens_are_refused(shared_model, cu_seqlens, message: str) -> None:
    model = shared_model("qwen2")
    with pytest.raises(ValueError, match=message):
        packed_logprobs(model, torch.zeros(6, dtype=torch.long), torch.tensor(cu_seqlens))


def test_bad_temperature_and_token_dtype_are_refused(shared_model) -> None:
    model = shared_model("qwen2")
    with pytest.raises(ValueError, match=r"temperature=0\.0 must be a positive finite number"):
        packed_logprobs(
            model, torch.zeros(3, dtype=torch.long), torch.tensor([0, 3]), temperature=0.0
        )
    with pytest.raises(ValueError, match=r"token_ids must be integers, got torch.float32"):
        packed_logprobs(model, torch.zeros(3), torch.tensor([0, 3]))


def test_attention_that_ignores_packing_is_refused() -> None:
    stub = SimpleNamespace(
        config=SimpleNamespace(_attn_implementation="paged|sdpa"), device=torch.device("cpu")
    )
    with pytest.raises(ValueError, match=r"'paged\|sdpa' does not keep packed sequences apart"):
        packed_logprobs(stub, torch.zeros(3, dtype=torch.long), torch.tensor([0, 3]))
