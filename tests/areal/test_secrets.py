"""Secrets never leave the process through a written config, and key folders are private."""

from __future__ import annotations

import dataclasses
import stat

import yaml

from areal.auth import init_keys
from areal.config import config_from_dict, config_to_dict, config_to_yaml, load_config


def test_the_secret_is_redacted_from_every_written_config():
    cfg = load_config(overrides=["controller.secret=hunter2-do-not-write", "trainer.lr=3e-4"])
    assert cfg.controller.secret == "hunter2-do-not-write"
    text = config_to_yaml(cfg)
    assert "hunter2" not in text and yaml.safe_load(text)["controller"]["secret"] is None
    data = config_to_dict(cfg)
    assert data["controller"]["secret"] is None and data["trainer"]["lr"] == 3e-4
    rebuilt = config_from_dict(data)  # what a worker rebuilds from Welcome.config
    assert rebuilt == dataclasses.replace(
        cfg, controller=dataclasses.replace(cfg.controller, secret=None)
    )


def test_key_folders_are_readable_by_their_owner_only(tmp_path):
    keys = init_keys(tmp_path / "keys")
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for name in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE((keys / name).stat().st_mode) == 0o600
