"""Config: YAML + dotted overrides round-trip; wrong names, types and values are named."""

from __future__ import annotations

import pytest

from areal.config import (
    ConfigError,
    RunConfig,
    config_from_dict,
    config_to_dict,
    config_to_yaml,
    describe_options,
    load_config,
)


def test_defaults_load_and_validate():
    cfg = load_config()
    assert cfg == RunConfig()
    assert cfg.eta == cfg.staleness.eta


def test_yaml_then_overrides_take_precedence(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  lr: 0.001\n  batch_size: 32\nrollout:\n  engine: vllm\n")
    cfg = load_config(path, ["trainer.lr=1e-5", "task.group_size=4", "mode=sync"])
    assert cfg.trainer.lr == 1e-5  # command line beats file
    assert cfg.trainer.batch_size == 32  # file beats default
    assert cfg.rollout.engine == "vllm"
    assert cfg.task.group_size == 4
    assert cfg.eta == 0  # sync mode forces eta = 0


def test_round_trip_through_yaml_and_dict(tmp_path):
    cfg = load_config(
        overrides=["trainer.ppo.eps_clip_high=0.28", "task.params={n: 3}", "rollout.devices=[cpu]"]
    )
    path = tmp_path / "resolved.yaml"
    path.write_text(config_to_yaml(cfg))
    assert load_config(path) == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    "override, needle",
    [
        ("trainer.lrr=1e-5", "trainer.lrr"),
        ("trainer.lr=fast", "trainer.lr"),
        ("rollout.engine=vlm", "rollout.engine='vlm' is not one of auto, torch, vllm"),
        ("trainer.batch_size=12", "not a multiple of task.group_size"),
        ("rollout.temperature=-1", "rollout.temperature"),
        ("rollout.top_p=0", "rollout.top_p"),
        ("trainer.ppo.behav_imp_cap=0.5", "trainer.ppo.behav_imp_cap"),
        ("model.path=/does/not/exist", "model.path"),
        ("model.tiny.num_heads=8", "head_dim"),
        ("controller.heartbeat_timeout_s=0", "controller.heartbeat_timeout_s=0.0 must be > 0"),
        ("controller.heartbeat_interval_s=0", "controller.heartbeat_interval_s=0.0 must be > 0"),
        ("controller.heartbeat_interval_s=10.5", "must be at least three times"),
        ("controller.heartbeat_interval_s=10", None),
        ("controller.heartbeat_timeout_s=1", None),  # the automatic interval: a third of it
        ("trainer.checkpoint_every=-1", "trainer.checkpoint_every"),
        ("trainer.keep_checkpoints=1", "trainer.keep_checkpoints=1 must be >= 2"),
        ("rollout.num_workers=2", None),
        ("episode.max_turns=0", "episode.max_turns=0 must be > 0"),
        ("episode.max_turn_tokens=0", "episode.max_turn_tokens=0 must be > 0"),
        ("episode.step_timeout_s=0", "episode.step_timeout_s=0.0 must be > 0"),
        ("episode.environment=' '", "episode.environment=' ' is empty"),
        ("agent.function=calculator", "agent.function='calculator' is not an import path"),
        ("agent.discount=1.5", r"agent.discount=1.5 must be in \[0, 1\]"),
        ("agent.max_calls=0", r"agent.max_calls=0 must be in \[1, 4096\]"),
        ("agent.observation_template=x", "has no {result}"),
        (
            "controller.gc_thresholds=[50000,20]",
            r"controller.gc_thresholds=\[50000, 20\]: three "
            "positive integers",
        ),
        ("controller.gc_thresholds=[0,10,10]", r"controller.gc_thresholds=\[0, 10, 10\]"),
        ("controller.gc_thresholds=[]", None),
        ("lr", "key=value"),
    ],
    ids=lambda v: str(v),
)
def test_bad_values_name_the_field(override, needle):
    if needle is None:
        load_config(overrides=[override])
        return
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_config(overrides=[override])


@pytest.mark.parametrize(
    "overrides, interval",
    [
        ([], 1.0),  # the default run's 4 workers
        (["rollout.num_workers=400", "reward.num_workers=50", "trainer.num_ranks=50"], 1.0),
        (["rollout.num_workers=1536", "reward.num_workers=32", "trainer.num_ranks=512"], 4.16),
        (["rollout.num_workers=12000"], 10.0),  # at most a third of the 30-s timeout
        (["controller.heartbeat_timeout_s=1.5"], 0.5),
        (["rollout.num_workers=1536", "controller.heartbeat_interval_s=0.5"], 0.5),  # as set
    ],
    ids=lambda v: str(v),
)
def test_the_heartbeat_interval_grows_with_the_workers_past_500(overrides, interval):
    assert load_config(overrides=overrides).heartbeat_interval() == pytest.approx(interval)


def test_bad_file_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  nope: 1\n")
    with pytest.raises(ConfigError, match="bad.yaml.*trainer.nope"):
        load_config(path)
    path.write_text("- just a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_every_option_is_documented():
    options = list(describe_options())
    assert len(options) > 40
    undocumented = [key for key, _, help_text in options if not help_text]
    assert not undocumented
    assert ("trainer.lr", "0.0001", "AdamW learning rate") in options


def test_an_agent_and_an_environment_exclude_each_other():
    with pytest.raises(ConfigError, match="set episode.environment=null"):
        load_config(overrides=["agent.function=a.b:run", "episode.environment=tools"])


def test_model_tokenizer_and_run_directories_are_named_once_set_and_refused_while_null(tmp_path):
    model, tok = tmp_path / "model", tmp_path / "tok"
    model.mkdir()
    tok.mkdir()
    cfg = load_config(overrides=[f"model.path={model}", f"run_dir={tmp_path / 'run'}"])
    assert cfg.model.model_dir() == cfg.model.tokenizer_dir() == str(model)
    assert cfg.run_path() == tmp_path / "run"
    tokenizer = load_config(overrides=[f"model.path={model}", f"model.tokenizer_path={tok}"])
    assert tokenizer.model.tokenizer_dir() == str(tok)
    unset = load_config()  # the embedded model: the controller's set-up names both
    with pytest.raises(ConfigError, match="model.path is null"):
        unset.model.model_dir()
    with pytest.raises(ConfigError, match="model.path is null"):
        unset.model.tokenizer_dir()
    with pytest.raises(ConfigError, match="run_dir is null"):
        unset.run_path()
