"""Every component of a run, made and wired in one place (`build_core`).

The controller (controller.py) calls it once the run is set up and connected; tests of the
decisions call it with a pool of their own and read what each decision sends from its
Outbox. Each component owns its state (see controller.py's docstring for who owns what);
the callbacks wired here are how one component's decision continues in another's (a sample
scored completes its group, a reward failure drops its group).
"""

from __future__ import annotations

from typing import Any
from collections.abc import Awaitable, Callable

from areal import clock
from areal.config import RunConfig
from areal.controller.admission import Admission
from areal.controller.core import Core
from areal.controller.evaluations import Evaluations
from areal.controller.generation import Generation
from areal.controller.ledger import Group, Ledger
from areal.controller.metrics import MetricsSink
from areal.controller.outbox import Outbox
from areal.controller.peer_log import PeerLog
from areal.controller.pool import WorkerPool
from areal.controller.report import StepReport
from areal.controller.scoring import Scoring
from areal.controller.setup import RunSetup
from areal.controller.signal import Changed
from areal.controller.train_driver import TrainDriver
from areal.controller.trainers import Trainers
from areal.controller.weight_sync import WeightSync, make_weight_sync


def build_core(
    cfg: RunConfig,
    setup: RunSetup,
    pool: WorkerPool,
    metrics: MetricsSink,
    *,
    changed: Changed,
    send: Callable[[Outbox], Awaitable[None]],
    address: str,
    group_filters: list[Callable[[Group], str | None]],
    stopping: Callable[[], bool],
    vocab_size: int | None,
    started: float,
    intake_cpu_s: Callable[[], float] = lambda: 0.0,
) -> Core:
    """Every component of a run, wired: the one place they are made. `send`: carries out an
    Outbox (the shell's); `address`: where remote workers connect; `stopping`: whether the
    run was asked to stop; `started`: when it started (clock.now()); `intake_cpu_s`: the
    CPU seconds the channel's intake has spent so far (areal/intake.py)."""
    core: Core

    def record_event(event: str, **values: Any) -> None:
        metrics.record("event", {"event": event, "version": weights.version, **values})

    def drop(group: Group, reason: str, out: Outbox) -> None:
        core.drop_group(group, reason, out)

    ledger = Ledger()
    peer_log = PeerLog(record_event, clock=clock.now)
    report = StepReport()
    trainers = Trainers(
        cfg,
        pool,
        changed,
        send,
        address,
        record_event,
        metrics.console,
        lambda worker_id: setup.run_dir / "logs" / f"{worker_id}.log",
        lambda: weights.trainers_lost(),
    )
    weights: WeightSync = make_weight_sync(
        cfg, setup.run_dir, pool, record_event, lambda: trainers.group.store
    )
    admission = Admission(cfg, ledger, changed, lambda: weights.version, stopping)
    generation = Generation(cfg, ledger, pool, setup.stop_token_ids)
    scoring = Scoring(
        cfg,
        ledger,
        report,
        refuse=lambda identity, reason, detail: core.refuse(identity, reason, detail),
        on_complete=lambda group, out: core.group_done(group, out),
        drop=drop,
    )
    evaluations = Evaluations(ledger, setup.eval_prompts, cfg.eval.num_samples)
    driver = TrainDriver(
        cfg,
        setup,
        ledger,
        admission,
        generation,
        scoring,
        evaluations,
        trainers,
        pool,
        metrics,
        peer_log,
        changed,
        report,
        version=lambda: weights.version,
        stopping=stopping,
        send=send,
        drop=drop,
        malformed=lambda: core.num_malformed,
        intake_cpu_s=intake_cpu_s,
        record_event=record_event,
        started=started,
    )
    core = Core(
        cfg,
        setup,
        ledger,
        pool,
        admission,
        generation,
        scoring,
        evaluations,
        weights,
        trainers,
        driver,
        peer_log,
        changed,
        record_event,
        group_filters,
        vocab_size,
    )
    pool.on_refused = core.registration_refused
    return core
