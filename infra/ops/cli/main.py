"""Entry point of the `specdeploy` command.

Each subcommand lives in its own module under ``infra.ops.cli`` and exposes
``register(subparsers)``; the module adds its parser and sets ``func`` to a
callable taking the parsed namespace and returning an exit code. Modules must
not import torch, transformers or pulumi at top level: the command starts fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from serving import __version__

# Modules under infra.ops.cli that contribute subcommands, in help order.
COMMAND_MODULES: tuple[str, ...] = (
    "config_cmd",
    "weights_cmd",
    "image_cmd",
    "serve_cmd",
    "local_cmd",
    "plan_cmd",
    "preview_cmd",
    "release_cmd",
    "bench_cmd",
    "validate_cmd",
)


class CommandError(Exception):
    """A user-facing failure: printed as one line, exit code 2, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdeploy",
        description="Deploy an LLM inference service and prove it is fit for traffic.",
    )
    parser.add_argument("--version", action="version", version=f"specdeploy {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--project", type=Path, metavar="DIR",
                        help="the Pulumi project (directory of Pulumi.yaml); default: found upward from the "
                             "working directory, as `pulumi` finds it")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"infra.ops.cli.{name}")
        module.register(subparsers)
    return parser


def registered_commands(parser: argparse.ArgumentParser | None = None) -> set[str]:
    """Names of the top-level subcommands this build provides."""
    parser = parser or build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    return set()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    from infra.config import ConfigError, use_project

    try:
        use_project(args.project)
        return int(args.func(args) or 0)
    except (CommandError, ConfigError) as exc:
        sys.stderr.write(f"specdeploy: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("specdeploy: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
