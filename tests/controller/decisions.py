"""A run's components built as the controller builds them (`build_core`), for tests of its
decisions: no socket, no worker process, no event loop needed. Workers are registered
through the decisions themselves (`join`), and every decision is read from its Outbox."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from areal import clock
from areal.config import RunConfig, load_config
from areal.controller.components import build_core
from areal.controller.core import Core
from areal.controller.metrics import MetricsSink
from areal.controller.outbox import Outbox
from areal.controller.pool import WorkerHandle, WorkerPool
from areal.controller.setup import RunSetup
from areal.controller.signal import Changed
from areal.messages import FinishReason, Generated, Ready, Scored, WorkerKind
from areal.tasks.base import Prompt, Verdict
from registers import register

SECRET = "s3cret"
PROMPT_IDS = np.array([5, 6, 7], np.int32)


def config(tmp_path: Path, *overrides: str) -> RunConfig:
    return load_config(
        overrides=[
            f"run_dir={tmp_path}",
            "logging.tensorboard=false",
            "logging.progress=false",
            "task.group_size=2",
            "trainer.batch_size=4",
            "rollout.max_new_tokens=8",
            "staleness.eta=1",
            *overrides,
        ]
    )


class Decisions:
    """The core of a run of `cfg`, and what its shell was asked to send."""

    def __init__(self, cfg: RunConfig, run_dir: Path, num_eval_prompts: int = 1) -> None:
        self.cfg = cfg
        self.changed = Changed()
        self.outboxes: list[Outbox] = []
        self.stopping = False
        setup = RunSetup(
            cfg=cfg,
            run_dir=run_dir,
            task=None,
            tokenizer=None,
            eval_prompts=[
                (Prompt(prompt_id=f"e{i}", text="", reference="1"), PROMPT_IDS)
                for i in range(num_eval_prompts)
            ],
            stop_token_ids=[0],
            config_dict={"run": "test"},
        )
        self.pool = WorkerPool(cfg, run_dir, "tcp://127.0.0.1:1", SECRET)
        self.metrics = MetricsSink(cfg, run_dir, cfg.trainer.total_steps, [])
        self.core: Core = build_core(
            cfg,
            setup,
            self.pool,
            self.metrics,
            changed=self.changed,
            send=self._send,
            address="tcp://127.0.0.1:1",
            group_filters=[],
            stopping=lambda: self.stopping,
            vocab_size=None,
            started=clock.now(),
        )

    async def _send(self, out: Outbox) -> None:
        self.outboxes.append(out)

    def on(self, identity: bytes, msg: object, members: list[bytes] | None = None) -> Outbox:
        return self.core.on_message(identity, msg, clock.now(), members)

    def join(self, kind: WorkerKind, index: int = 0, rank: int = 0) -> WorkerHandle:
        """A worker registers and becomes ready, through the core's own decisions."""
        identity = f"{kind.value}-{index}".encode()
        self.on(
            identity,
            register(
                kind, f"{kind.value}-{index}", SECRET, pid=os.getpid(), host="test", rank=rank
            ),
        )
        self.on(identity, Ready(version=self.core.weights.version))
        return self.pool.get(identity)

    def admit(self, num_groups: int) -> None:
        for i in range(num_groups):
            self.core.admission.admit(
                i, Prompt(prompt_id=f"p{i}", text="", reference="1"), PROMPT_IDS
            )


def generated(request_id: str, num_tokens: int = 3, version: int = 0, **fields) -> Generated:
    return Generated(
        request_id=request_id,
        output_ids=np.arange(1, num_tokens + 1, dtype=np.int32),
        logprobs=np.full(num_tokens, -0.5, np.float32),
        versions=np.full(num_tokens, version, np.int32),
        finish_reason=FinishReason.STOP,
        **fields,
    )


def scored(request_ids: list[str], rewards: list[float], verdicts: list[Verdict]) -> Scored:
    """A reward worker's answer: each request's reward and verdict, no detail, no time."""
    return Scored(
        request_ids=request_ids,
        rewards=rewards,
        verdicts=verdicts,
        details=[""] * len(request_ids),
        check_s=[0.0] * len(request_ids),
    )
