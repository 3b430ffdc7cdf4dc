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


def _importable(module: str) -> bool:
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    """Files with slow tests first; vLLM and Ray tests skip with a reason where the package is
    absent, but fail in CI's stage for it (AREAL_REQUIRE_VLLM=1, AREAL_REQUIRE_RAY=1).

    The order: the two test processes (`-n 2 --dist loadfile`) take whole files in the order
    collected, so the files that take minutes start first and the many quick ones fill in
    around them, instead of one process finishing a long file alone at the end.
    """
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: files stay in order
    for marker, module, extra in (("vllm", "vllm", "vllm"), ("ray", "ray", "ray")):
        if _importable(module) or os.environ.get(f"AREAL_REQUIRE_{marker.upper()}") == "1":
            continue
        skip = pytest.mark.skip(reason=f"{module} is not installed (pip install -e '.[{extra}]')")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
