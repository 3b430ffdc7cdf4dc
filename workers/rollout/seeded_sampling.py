"""Per-request seeded sampling for the torch engine (transformers' continuous batching).

transformers samples every row of a forward with one `torch.multinomial` call on the
process-global generator, so a request's tokens depend on which other requests shared each
forward (timing). With `SamplingParams.seed`, a request's t-th completion token is instead
drawn by inverting the CDF of its distribution at u_t = `areal.seeds.uniform(seed, t)`:

    probs = softmax(processed scores)          (as transformers: temperature, top-k, top-p)
    token = min{ i : cumsum(probs)[i] > u_t * sum(probs) }     (float64 cumsum)
    logprob = log(probs[token])                (as transformers)

an exact draw from `probs` (up to the 2**-24 grid of u), that depends on the request's seed,
its prompt and the weights only. Greedy requests (top-k = 1) have a one-hot `probs` and get
the argmax whatever u. Requests without a seed are drawn by `torch.multinomial` as before.

How it plugs in (transformers 5.19): `SeededDraws` is a per-request logits processor that
leaves the scores unchanged; its per-request argument is u_t, computed on the generation
thread when the batch is prepared (row order = the logits' rows), and handed to the
runner's `_sample`, which `install` replaces with `seeded_sample`. The position t is the
number of tokens the request generated before this one, which is exact only when each
batch is prepared after the previous one's tokens were appended: `install` refuses
asynchronous batching and CUDA graphs (the engine turns both off).

Not here: where seeds come from (areal.seeds, the controller), the engine's life cycle.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
)

from areal.seeds import uniform

_NO_SEED = float("nan")
"""The draw of a row without a seed: sampled by torch.multinomial instead."""


class SeededDraws(ContinuousBatchingLogitsProcessor):
    """Per-request uniform draws (the `seed` request keyword); scores pass unchanged."""

    supported_kwargs: dict[str, type] = {"seed": int}  # noqa: RUF012 (the base declares it per instance)
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.draws: torch.Tensor | None = None
        """[B] float32 draws of the rows of the forward being sampled (NaN: no seed)."""

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        default = torch.full(int32_tensor.shape, _NO_SEED, dtype=torch.float32)
        int32_tensor.copy_(default.view(dtype=torch.int32))

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        draws = []
        for request in requests_with_new_token:
            seed = request.state.logit_processor_kwargs.get("seed")
            draws.append(
                _NO_SEED if seed is None else uniform(seed, len(request.state.generated_tokens))
            )
        return torch.tensor(draws, dtype=torch.float32).view(dtype=torch.int32)

    def __call__(self, scores: torch.FloatTensor, tensor_arg: torch.Tensor) -> torch.FloatTensor:
        self.draws = tensor_arg[: scores.size(0)].view(dtype=torch.float32).clone()
        return scores


def install(manager: Any) -> SeededDraws:
    """Add `SeededDraws` to a manager's processors; call before its batch processor exists
    (before `warmup()`), then `install_sampler` after."""
    cb_config = manager.continuous_batching_config
    if cb_config.use_async_batching or any(cb_config.cuda_graph_booleans):
        raise RuntimeError(
            "seeded sampling needs synchronous batching without CUDA graphs "
            f"(use_async_batching={cb_config.use_async_batching}, "
            f"use_cuda_graph={cb_config.use_cuda_graph})"
        )
    if manager.batch_processor is not None:
        raise RuntimeError("install() must run before the manager's batch processor is built")
    draws = SeededDraws()
    processors = manager.logit_processor
    processors.logits_processor.append(draws)
    processors.tensors_required += 1
    processors.supported_keys.update(draws.supported_kwargs)
    processors.do_processing = True
    return draws


def install_sampler(manager: Any, draws: SeededDraws) -> None:
    """Replace the manager's sampling step by `seeded_sample` (after `warmup()`)."""
    runner = manager.batch_processor.model_runner
    if not runner.do_sample or not runner.return_logprobs:
        raise RuntimeError("seeded sampling expects do_sample and return_logprobs")

    def sample(scores: torch.Tensor, output_ids: torch.Tensor) -> Any:
        if draws.draws is None:
            raise RuntimeError("sampling before SeededDraws saw the forward's requests")
        return seeded_sample(draws.draws, scores, output_ids)

    runner._sample = sample


def seeded_sample(draws: torch.Tensor, scores: torch.Tensor, output_ids: torch.Tensor) -> None:
    """transformers' `ModelRunner._sample` with seeded rows: scores [1, B, V] processed;
    writes the B tokens into output_ids[0] and their log-probs (float32 bits) into
    output_ids[1]. `draws` [B]: each row's u, NaN for rows sampled by torch.multinomial."""
    probs = torch.nn.functional.softmax(scores[0], dim=-1)  # [B, V]
    tokens = torch.empty(probs.size(0), dtype=torch.long, device=probs.device)
    seeded = ~draws.isnan()
    if bool(seeded.any()):
        cdf = probs[seeded].double().cumsum(dim=-1)  # [S, V]
        target = draws[seeded].double().unsqueeze(-1) * cdf[:, -1:]
        chosen = torch.searchsorted(cdf, target, right=True).squeeze(-1)
        tokens[seeded] = chosen.clamp(max=probs.size(-1) - 1)
    if not bool(seeded.all()):
        tokens[~seeded] = torch.multinomial(probs[~seeded], num_samples=1).squeeze(-1)
    logprobs = probs.gather(dim=1, index=tokens.unsqueeze(-1)).squeeze(-1).log()
    count = tokens.size(0)
    output_ids[0, :count].copy_(tokens)
    output_ids[1, :count].copy_(logprobs.view(dtype=torch.int32))
