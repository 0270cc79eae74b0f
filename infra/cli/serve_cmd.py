"""`specdeploy serve --config FILE`: run the inference server in the foreground (the image's entrypoint)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from infra.cli.main import CommandError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible inference server",
        description="Run the server from its config file. SPECDEPLOY__<SECTION>__<KEY> environment variables "
        "override single keys; API keys come from service.api_keys_env or service.api_keys_file; "
        "SPECDEPLOY_ENV=development allows running without keys. SIGTERM drains, then exits 0.",
    )
    parser.add_argument("--config", default=os.environ.get("SPECDEPLOY_CONFIG"), metavar="FILE",
                        help="server config YAML (default: $SPECDEPLOY_CONFIG)")
    parser.add_argument("--host", default=None, help="override service.host")
    parser.add_argument("--port", type=int, default=None, help="override service.port")
    parser.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from serving.api.settings import Settings
    from serving.config import ConfigError

    if not args.config:
        raise CommandError("no config file: pass --config FILE or set SPECDEPLOY_CONFIG")
    environ = dict(os.environ)
    if args.host is not None:
        environ["SPECDEPLOY__SERVICE__HOST"] = args.host
    if args.port is not None:
        environ["SPECDEPLOY__SERVICE__PORT"] = str(args.port)
    try:
        settings = Settings.from_file(args.config, environ)
    except ConfigError as exc:
        raise CommandError(str(exc)) from exc

    from serving.main import run

    return run(settings)
