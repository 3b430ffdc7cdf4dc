"""What the trainer tests build around a real `PPOTrainer`: packed sequences of random tokens
with the tiny model's own log-probs (each test perturbs them into behaviour log-probs its
own way), and an optimiser that records the gradients it is handed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areal.models.hf import load_model
from areal.models.logprobs import packed_logprobs
from areal.workers.trainer.ppo import PPOTrainer


@dataclass(frozen=True)
class Sequences:
    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    loss_mask: torch.Tensor
    """False on each sequence's prompt."""
    own_logprobs: torch.Tensor
    """The model's log-probs of the tokens (temperature 1)."""


def random_sequences(
    model_dir: str, lengths: list[int], num_prompt: int, gen: torch.Generator
) -> Sequences:
    """Sequences of `lengths` random tokens whose first `num_prompt` are the prompt."""
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    tokens = torch.randint(3, 90, (sum(lengths),), generator=gen)
    mask = torch.ones(sum(lengths), dtype=torch.bool)
    for start in cu[:-1].tolist():
        mask[start : start + num_prompt] = False
    with torch.no_grad():
        own = packed_logprobs(load_model(model_dir), tokens, cu, temperature=1.0)
    return Sequences(tokens, cu, mask, own)


def record_gradients(trainer: PPOTrainer) -> list[dict[str, torch.Tensor]]:
    """Make the optimiser record the (reduced, clipped) gradients of every step it takes."""
    recorded: list[dict[str, torch.Tensor]] = []
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        grads = {}
        for name, param in trainer.model.named_parameters():
            grad = param.grad
            if grad is None:  # frozen (LoRA's base)
                continue
            if hasattr(grad, "full_tensor"):  # FSDP2 shard: gather (every rank calls this)
                grad = grad.full_tensor()
            grads[name] = grad.detach().clone()
        recorded.append(grads)
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    return recorded
