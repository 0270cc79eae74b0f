"""`specdeploy up|down|status --stack local`: the local platform (server on loopback, no cloud)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from infra.ops.cli.main import CommandError


def register(subparsers: Any) -> None:
    up = subparsers.add_parser("up", help="start the local deployment: weights → store → verified cache → server")
    _common(up)
    up.add_argument("--target-dir", type=Path, default=None, help="model to publish (default: the demo target)")
    up.add_argument("--draft-dir", type=Path, default=None, help="draft to publish (default: the demo draft)")
    up.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for /ready")
    up.add_argument("--quiet", action="store_true", help="no progress bars")
    up.set_defaults(func=_up)

    down = subparsers.add_parser("down", help="drain and stop the local server")
    _common(down)
    down.set_defaults(func=_down)

    status = subparsers.add_parser("status", help="show the local server's process, health and readiness")
    _common(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=_status)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stack", default="local", help="a platform `local` stack (default: local)")
    parser.add_argument("--stacks-dir", type=Path, help=argparse.SUPPRESS)


def _deployment(args: argparse.Namespace) -> Any:
    from infra.config import ConfigError, load_stack
    from infra.ops.local import LocalDeployment, LocalError

    try:
        return LocalDeployment(load_stack(args.stack, args.stacks_dir))
    except (ConfigError, LocalError) as exc:
        raise CommandError(str(exc)) from exc


def _up(args: argparse.Namespace) -> int:
    from rich.console import Console

    from infra.ops.cli.weights_cmd import RichProgress
    from infra.ops.local import LocalError

    deployment = _deployment(args)
    target_dir, draft_dir = args.target_dir, args.draft_dir
    if target_dir is None or draft_dir is None:
        import serving.demo

        target_dir = target_dir or serving.demo.target_path()
        draft_dir = draft_dir or serving.demo.draft_path()
    try:
        with RichProgress(not args.quiet) as progress:
            status = deployment.up(target_dir, draft_dir, progress)
            if not status.is_ready:
                status = deployment.wait_ready(args.timeout)
    except LocalError as exc:
        raise CommandError(str(exc)) from exc
    console = Console(highlight=False)
    model = deployment.config.model.name
    keys = deployment.paths.api_keys_file
    console.print(f"[bold green]ready[/]: {status.endpoint}  (model {model}, pid {status.pid})")
    console.print(f"log: {deployment.paths.log_file}   config: {deployment.paths.server_config}")
    console.print(f"API keys: {keys} (id:key per line)\n")
    body = json.dumps({"model": model, "max_tokens": 64,
                       "messages": [{"role": "user", "content": "Write a Python function that reverses a list."}]})
    console.print("try it:", soft_wrap=True)
    console.print(
        f"  curl -s {status.endpoint}/v1/chat/completions \\\n"
        f"    -H \"Authorization: Bearer $(head -1 {keys} | cut -d: -f2)\" \\\n"
        f"    -H 'Content-Type: application/json' \\\n"
        f"    -d '{body}'",
        soft_wrap=True, markup=False,
    )
    console.print(f"stop it:  specdeploy down --stack {args.stack}")
    return 0


def _down(args: argparse.Namespace) -> int:
    from rich.console import Console

    deployment = _deployment(args)
    stopped = deployment.down()
    Console().print("stopped (drained)" if stopped else "not running")
    return 0


def _status(args: argparse.Namespace) -> int:
    from rich.console import Console

    deployment = _deployment(args)
    status = deployment.status()
    if args.json:
        Console().print_json(json.dumps({
            "running": status.running, "pid": status.pid, "endpoint": status.endpoint,
            "ready": status.is_ready, "health": status.health, "readiness": status.ready,
        }))
    else:
        console = Console(highlight=False)
        if not status.running:
            console.print(f"not running (stack {args.stack})")
        else:
            reason = (status.ready or {}).get("reason", "no answer")
            console.print(f"running: pid {status.pid}, {status.endpoint}")
            console.print(f"health: {(status.health or {}).get('status', 'no answer')}   ready: {reason}")
            console.print(f"log: {deployment.paths.log_file}")
    return 0 if status.is_ready else 1
