"""`python -m areal.controller [--config FILE | --resume RUN_DIR] [key=value ...]`: run one
training job, or continue one from its newest checkpoint. Its workers are started by the
launcher the config names (`launcher=local|ray`, areal.controller.launch).

SIGTERM or SIGINT (Ctrl-C) stop the run as `Controller.stop()` does: the current step
finishes, the final evaluation runs, the summary is written, the workers are shut down; the
exit code is then 128 + the signal's number. A second signal ends it at once (no summary).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import textwrap

from areal.config import ConfigError, describe_options, load_config
from areal.controller import preload


def _options_help() -> str:
    lines = ["options (set in the YAML file or as key=value; defaults shown):", ""]
    for key, default, help_text in describe_options():
        lines.append(f"  {key} = {default}")
        lines.extend(
            textwrap.wrap(help_text, 88, initial_indent="      ", subsequent_indent="      ")
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m areal.controller",
        description="Train a language model with fully asynchronous RL. With no arguments: "
        "the embedded tiny model on the synthetic arithmetic task, on this CPU.",
        epilog=_options_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", metavar="FILE", help="YAML file with any of the options")
    source.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its newest checkpoint, with its "
        "config.yaml (overrides still apply, e.g. trainer.total_steps=200)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, applied after the file (e.g. trainer.lr=1e-5)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = list(args.overrides)
    config_file = args.config
    if args.resume:
        config_file = f"{args.resume.rstrip('/')}/config.yaml"
        overrides.append(f"run_dir={args.resume}")
    try:
        cfg = load_config(config_file, overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.logging.level,
        stream=sys.stderr,
        format="%(asctime)s controller %(levelname)s %(name)s: %(message)s",
    )
    preload.warm(cfg)  # its imports overlap the controller's, just below
    import uvloop

    from areal.controller.controller import Controller, RunFailed

    signals: list[int] = []
    controller = Controller(cfg, resume=bool(args.resume))  # its runtime: cfg.launcher
    try:
        uvloop.run(_run_until_signalled(controller, signals))
    except RunFailed as err:
        print(f"error: the run failed: {err}", file=sys.stderr)
        return _exit(cfg, 1)
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted", file=sys.stderr)
        return _exit(cfg, 130)
    return _exit(cfg, 128 + signals[0] if signals else 0)


def _exit(cfg, code: int) -> int:
    """`code`; with launcher=ray, the process ends here. Ray's core worker, once it has
    seen a SIGTERM, aborts while the interpreter finalizes (exit -6 instead of 143 after a
    graceful stop); the run is over and its files are closed by then, so finalization is
    skipped."""
    if cfg.launcher != "ray":
        return code
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _run_until_signalled(controller, signals: list[int]) -> None:
    """Run; the first SIGTERM/SIGINT stops the run gracefully, a second cancels it."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None  # called from the CLI's main task

    def on_signal(signum: int) -> None:
        signals.append(signum)
        if len(signals) > 1:
            main.cancel()
            return
        print(
            f"\n{signal.Signals(signum).name}: stopping after the current step (the final "
            "evaluation and the summary follow; send it again to end at once)",
            file=sys.stderr,
        )
        controller.stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await controller.run()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


if __name__ == "__main__":
    sys.exit(main())
