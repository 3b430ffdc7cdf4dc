"""Shared fixtures: free ports, the embedded tiny model, marker handling."""

from __future__ import annotations

import os
import socket

import pytest


@pytest.fixture
def free_port() -> int:
    """A TCP port that was free on loopback a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A randomly initialised embedded-architecture model (Qwen2 + char tokenizer) on disk."""
    from areal.models.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tiny-model")))


def pytest_collection_modifyitems(config, items):
    """vLLM tests skip with a reason where vLLM is absent, but fail in CI (AREAL_REQUIRE_VLLM=1)."""
    try:
        import vllm  # noqa: F401
        have_vllm = True
    except ImportError:
        have_vllm = False
    if have_vllm or os.environ.get("AREAL_REQUIRE_VLLM") == "1":
        return
    skip = pytest.mark.skip(reason="vLLM is not installed (pip install -e '.[vllm]')")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)
