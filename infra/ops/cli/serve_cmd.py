"""`specdeploy serve --config FILE`: the server in the foreground, as ``python -m serving`` runs it."""

from __future__ import annotations

import argparse
from typing import Any

from infra.ops.cli.main import CommandError


def register(subparsers: Any) -> None:
    from serving.cli import DESCRIPTION, add_arguments

    parser = subparsers.add_parser("serve", help="run the OpenAI-compatible inference server",
                                   description=DESCRIPTION)
    add_arguments(parser)
    parser.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from serving.cli import serve
    from serving.config import ConfigError

    try:
        return serve(args.config, args.host, args.port)
    except ConfigError as exc:
        raise CommandError(str(exc)) from exc
