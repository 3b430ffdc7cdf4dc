"""Shared fixtures: free ports, the embedded tiny model, marker handling, and the order and
grouping of tests for pytest-xdist (the suite runs on two workers: pyproject.toml)."""

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


SHARED_GROUPS = {"ray": "ray", "slurm": "slurm"}
"""Marker -> xdist group: the tests that start a local Ray cluster, or submit to this machine's
Slurm, run on one worker, one at a time, whatever file they are in."""


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist hands out work a file at a time (an xdist group, for tests that have one),
    so that a module-scoped fixture (one real run shared by a file's assertions) is made once,
    on one worker. Files go out in collection order (see pytest_collection_modifyitems)."""
    from xdist.scheduler import LoadGroupScheduling

    class FileOrGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):  # as LoadGroupScheduling reads it
                return nodeid.rsplit("@", 1)[-1]
            return nodeid.split("::", 1)[0]

    return FileOrGroupScheduling(config, log)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """Order and group the tests for pytest-xdist, then skip what cannot run here.

    Files with slow tests come first, so that on two workers the long ones start early and
    the many short ones fill the end of the run. Tests with a SHARED_GROUPS marker get that
    xdist group (they run on one worker, one file after the other).

    vLLM and Ray tests skip with a reason where the package is absent, but fail in CI's
    stage for it (AREAL_REQUIRE_VLLM=1, AREAL_REQUIRE_RAY=1)."""
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: file order kept
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            shared = [group for marker, group in SHARED_GROUPS.items() if marker in item.keywords]
            if shared:
                item.add_marker(pytest.mark.xdist_group(shared[0]))
    for marker, module, extra in (("vllm", "vllm", "vllm"), ("ray", "ray", "ray")):
        if _importable(module) or os.environ.get(f"AREAL_REQUIRE_{marker.upper()}") == "1":
            continue
        skip = pytest.mark.skip(reason=f"{module} is not installed (pip install -e '.[{extra}]')")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
