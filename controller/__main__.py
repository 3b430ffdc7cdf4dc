"""`python -m areal.controller [--config FILE | --resume RUN_DIR] [key=value ...]`: run one
training job, or continue one from its newest checkpoint."""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap

from areal.config import ConfigError, describe_options, load_config


def _options_help() -> str:
    lines = ["options (set in the YAML file or as key=value; defaults shown):", ""]
    for key, default, help_text in describe_options():
        lines.append(f"  {key} = {default}")
        lines.extend(textwrap.wrap(help_text, 88, initial_indent="      ",
                                   subsequent_indent="      "))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m areal.controller",
        description="Train a language model with fully asynchronous RL. With no arguments: "
                    "the embedded tiny model on the synthetic arithmetic task, on this CPU.",
        epilog=_options_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", metavar="FILE", help="YAML file with any of the options")
    source.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the run in RUN_DIR from its newest checkpoint, with its "
                             "config.yaml (overrides still apply, e.g. trainer.total_steps=200)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, applied after the file (e.g. trainer.lr=1e-5)")
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
    logging.basicConfig(level=cfg.logging.level, stream=sys.stderr,
                        format="%(asctime)s controller %(levelname)s %(name)s: %(message)s")
    import uvloop

    from areal.controller.controller import Controller, RunFailed

    try:
        uvloop.run(Controller(cfg, resume=bool(args.resume)).run())
    except RunFailed as err:
        print(f"error: the run failed: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
