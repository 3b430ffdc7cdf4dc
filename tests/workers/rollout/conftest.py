"""Fixtures for the rollout-engine tests: two weight sets of the embedded tiny model and a
factory of real `TorchEngine`s (helpers are in rollout_helpers.py).

Nothing here mocks the engine: every test runs transformers' continuous batching on CPU.
"""

from __future__ import annotations

from pathlib import Path
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import pytest_asyncio
import torch

from areal.models.hf import load_model
from areal.models.tiny import save_tiny_model
from areal.workers.rollout.torch_engine import TorchEngine


@pytest.fixture(autouse=True)
def single_torch_thread() -> Iterator[None]:
    """One intra-op thread (tiny model, busy 2-core machine), restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def save_peaked_tiny_model(directory: Path, seed: int) -> Path:
    """The embedded tiny Qwen2 with every matrix redrawn from N(0, 0.2^2).

    At the default init (std 0.02) the random model just repeats the last prompt token, so
    two weight sets produce the same greedy text; at 0.2 outputs vary with the weights and
    the next-token distributions are peaked (max prob ~0.75), like a trained model's.
    """
    save_tiny_model(directory, seed=seed)
    model = load_model(directory)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def weights_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two directories of the tiny Qwen2 with different weights (policy versions 0 and 1)."""
    return (
        save_peaked_tiny_model(tmp_path_factory.mktemp("tiny_v0"), seed=0),
        save_peaked_tiny_model(tmp_path_factory.mktemp("tiny_v1"), seed=1),
    )


@pytest.fixture(scope="session")
def reference_models(weights_dirs: tuple[Path, Path]) -> tuple[torch.nn.Module, ...]:
    """Plain fp32 transformers models of both weight sets, for recomputation (read only)."""
    return tuple(load_model(d) for d in weights_dirs)


@pytest_asyncio.fixture
async def make_engine(
    weights_dirs: tuple[Path, Path],
) -> AsyncIterator[Callable[..., Awaitable[TorchEngine]]]:
    """`await make_engine(**kwargs)`: a started engine on weights v0, closed at teardown."""
    engines: list[TorchEngine] = []

    async def make(**kwargs) -> TorchEngine:
        kwargs.setdefault("max_concurrent", 64)
        engine = TorchEngine(weights_dirs[0], **kwargs)
        engines.append(engine)
        await engine.start()
        return engine

    yield make
    for engine in engines:
        await engine.close()
