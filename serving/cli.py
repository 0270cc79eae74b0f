"""`python -m serving --config FILE`: the server's own entry point (the image's CMD).

It needs nothing from infra/: the server image carries serving/ alone. ``specdeploy serve``
is the same command reached through the operator CLI.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from serving.config import ConfigError

CONFIG_ENV_VAR = "SPECDEPLOY_CONFIG"
DESCRIPTION = (
    "Run the server from its config file. SPECDEPLOY__<SECTION>__<KEY> environment variables "
    "override single keys; API keys come from service.api_keys_env or service.api_keys_file; "
    "SPECDEPLOY_ENV=development allows running without keys. SIGTERM drains, then exits 0."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE",
                        help=f"server config YAML (default: ${CONFIG_ENV_VAR})")
    parser.add_argument("--host", default=None, help="override service.host")
    parser.add_argument("--port", type=int, default=None, help="override service.port")


def serve(config: str | None, host: str | None = None, port: int | None = None) -> int:
    """Load the settings and run the server until it drains; ConfigError names a bad key or file."""
    from serving.api.settings import Settings

    path = config or os.environ.get(CONFIG_ENV_VAR)
    if not path:
        raise ConfigError(f"no config file: pass --config FILE or set {CONFIG_ENV_VAR}")
    environ = dict(os.environ)
    if host is not None:
        environ["SPECDEPLOY__SERVICE__HOST"] = host
    if port is not None:
        environ["SPECDEPLOY__SERVICE__PORT"] = str(port)
    settings = Settings.from_file(path, environ)
    # before torch loads: its CPU allocator reads the variable this sets at its first allocation
    from serving.engine import huge_pages

    huge_pages.apply(settings.config.model.cpu_huge_pages, settings.config.model.device)

    from serving.main import run

    code = run(settings)
    # The server has drained and shut down (engine stopped, lifespan done). Interpreter teardown with torch
    # loaded takes seconds, which would break the drain contract (exit within grace + 1 s): leave now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return serve(args.config, args.host, args.port)
    except ConfigError as exc:
        sys.stderr.write(f"specdeploy serve: error: {exc}\n")
        return 2
