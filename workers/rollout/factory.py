"""Choosing and building the inference engine a rollout worker runs (`rollout.engine`)."""

from __future__ import annotations

import importlib.util
import logging

from areal.config import RunConfig
from areal.workers.rollout.engine import Engine

log = logging.getLogger(__name__)


def resolve_engine_name(name: str) -> str:
    """'auto' -> 'vllm' when vLLM is importable, else 'torch'; others unchanged."""
    if name == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "torch"
    return name


async def make_engine(cfg: RunConfig, index: int = 0) -> Engine:
    """Build and start the configured engine for rollout worker `index`."""
    name = resolve_engine_name(cfg.rollout.engine)
    if name == "torch":
        from areal.workers.rollout.torch_engine import TorchEngine

        engine: Engine = TorchEngine.from_config(cfg, index)  # index: its device and seed
    elif name == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError(
                "rollout.engine='vllm' but vLLM is not installed; "
                "pip install -e '.[vllm]' or use rollout.engine=torch"
            )
        from areal.workers.rollout.vllm_engine import VllmEngine

        engine = VllmEngine.from_config(cfg, index)  # index: its GPU(s) and seed
    else:
        raise ValueError(f"rollout.engine={name!r} is not one of auto, torch, vllm")
    log.info("rollout engine: %s", name)
    await engine.start()
    return engine
