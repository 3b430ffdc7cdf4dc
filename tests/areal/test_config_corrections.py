"""The off-policy correction options: in --help with their choices, reachable from YAML and
the command line, and refused with the field named when out of range."""

from __future__ import annotations

import subprocess
import sys

import pytest

from areal.config import ConfigError, describe_options, load_config

OPTIONS = {
    "trainer.ppo.behav_imp_floor": "0.5",
    "trainer.ppo.behav_imp_level": "sequence",
    "trainer.ppo.behav_cap_mode": "clamp",
    "trainer.ppo.policy_loss": "cispo",
    "trainer.ppo.eps_clip_high": "0.28",
    "trainer.ppo.loss_agg_mode": "seq-mean-token-sum-norm",
    "trainer.ppo.loss_agg_norm": "4096",
    "trainer.advantage.dynamic_sampling": "true",
    "trainer.advantage.dynamic_sampling_max_drops": "50",
    "trainer.advantage.overlong_buffer": "16",
    "trainer.advantage.overlong_penalty": "0.5",
    "trainer.advantage.mask_truncated": "true",
}


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.slow
def test_every_option_appears_in_the_cli_help_with_its_choices():
    help_text = subprocess.run(
        [sys.executable, "-m", "areal.controller", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for key in OPTIONS:
        assert f"  {key} = " in help_text, key
    assert "[ppo|gspo|cispo]" in help_text
    assert "[token-mean|seq-mean-token-mean|seq-mean-token-sum-norm]" in help_text
    assert "[token|sequence]" in help_text
    documented = {key for key, _, text in describe_options() if text}
    assert set(OPTIONS) <= documented


def test_options_load_from_yaml_and_the_command_line(tmp_path):
    yaml_text = (
        "trainer:\n  ppo:\n    policy_loss: gspo\n    behav_imp_level: sequence\n"
        "  advantage:\n    dynamic_sampling: true\n"
    )
    (tmp_path / "run.yaml").write_text(yaml_text)
    cfg = load_config(tmp_path / "run.yaml")
    assert (cfg.trainer.ppo.policy_loss, cfg.trainer.ppo.behav_imp_level) == ("gspo", "sequence")
    assert cfg.trainer.advantage.dynamic_sampling is True
    cfg = load_config(tmp_path / "run.yaml", [f"{k}={v}" for k, v in OPTIONS.items()])
    for key, value in OPTIONS.items():
        got = _get(cfg, key)
        assert str(got).lower() == value or got == float(value), (key, got)


def test_defaults_are_the_papers_decoupled_ppo():
    ppo, adv = load_config().trainer.ppo, load_config().trainer.advantage
    assert (ppo.policy_loss, ppo.loss_agg_mode, ppo.behav_imp_level) == (
        "ppo",
        "token-mean",
        "token",
    )
    assert ppo.behav_imp_floor is None and ppo.eps_clip_high is None
    assert not adv.dynamic_sampling and not adv.mask_truncated and adv.overlong_buffer == 0


@pytest.mark.parametrize(
    "override, needle",
    [
        ("trainer.ppo.behav_imp_floor=1.5", "trainer.ppo.behav_imp_floor=1.5 must be in (0, 1)"),
        ("trainer.ppo.behav_imp_floor=0", "trainer.ppo.behav_imp_floor=0.0 must be in (0, 1)"),
        ("trainer.ppo.policy_loss=grpo", "trainer.ppo.policy_loss='grpo' is not one of ppo, gspo"),
        (
            "trainer.ppo.loss_agg_mode=seq-mean",
            "trainer.ppo.loss_agg_mode='seq-mean' is not one of",
        ),
        ("trainer.ppo.behav_imp_level=batch", "trainer.ppo.behav_imp_level='batch' is not one of"),
        ("trainer.ppo.loss_agg_norm=0", "trainer.ppo.loss_agg_norm=0 must be > 0"),
        (
            "trainer.advantage.dynamic_sampling_max_drops=-1",
            "trainer.advantage.dynamic_sampling_max_drops=-1 must be >= 0",
        ),
        (
            "trainer.advantage.overlong_buffer=-2",
            "trainer.advantage.overlong_buffer=-2 must be >= 0",
        ),
        (
            "trainer.advantage.overlong_buffer=100",
            "trainer.advantage.overlong_buffer=100 exceeds rollout.max_new_tokens=64",
        ),
    ],
)
def test_bad_values_name_the_field(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert needle in str(err.value)
