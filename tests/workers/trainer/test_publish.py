"""Disk publishing keeps the `keep_versions` newest versions of this run, and only those."""

from __future__ import annotations

import torch

from areal.config import load_config
from areal.workers.trainer.publish import publish_to_disk, version_dir


def _versions(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "weights").iterdir())


def test_publishing_keeps_the_newest_versions(tmp_path):
    cfg = load_config(overrides=[f"run_dir={tmp_path}", "weight_sync.keep_versions=2"])
    tensors = [("w", torch.ones(3))]
    for version in range(1, 5):
        assert publish_to_disk(tensors, cfg, version) == str(version_dir(tmp_path, version))
    assert _versions(tmp_path) == ["v000003", "v000004"]


def test_leftover_later_versions_do_not_remove_the_ones_being_published(tmp_path):
    """A run directory reused after an interrupted run holds its later versions; counting
    them as the newest removed each version as soon as it was published, so that rollout
    workers never found the weights they were told to load (seen in bench/ablation.py)."""
    cfg = load_config(overrides=[f"run_dir={tmp_path}", "weight_sync.keep_versions=2"])
    tensors = [("w", torch.ones(3))]
    for leftover in (9, 10):
        publish_to_disk(tensors, cfg, leftover)
    for version in range(1, 4):
        publish_to_disk(tensors, cfg, version)
        assert version_dir(tmp_path, version).is_dir()
    assert _versions(tmp_path) == ["v000002", "v000003", "v000009", "v000010"]
