"""`specdeploy plan --stack NAME`: the capacity plan of a stack (GPU memory, instance type, cost)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from infra.ops.cli.main import CommandError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("plan", help="capacity plan: GPU memory, instance type and cost of a stack")
    parser.add_argument("--stack", required=True, help="stack name, e.g. prod")
    parser.add_argument("--read-config", action="store_true",
                        help="read the models' config.json from their s3:// source (your AWS credentials)")
    parser.add_argument("--json", action="store_true", help="machine-readable summary")
    parser.add_argument("--candidates", action="store_true", help="also list every catalogued type and why it fits")
    parser.add_argument("--stacks-dir", type=Path, help=argparse.SUPPRESS)
    parser.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    from infra.capacity import CapacityError, plan, read_config_anywhere, read_local_config, render_candidates
    from infra.config import ConfigError, load_stack

    try:
        stack = load_stack(args.stack, args.stacks_dir)
        if stack.config.platform == "local":
            raise CommandError(f"stack {args.stack!r} is platform local: it runs on this machine's CPU, no plan")
        result = plan(stack.config, read_config_anywhere if args.read_config else read_local_config)
    except (ConfigError, CapacityError) as exc:
        raise CommandError(str(exc)) from exc
    if args.json:
        sys.stdout.write(json.dumps(result.as_dict(), indent=2) + "\n")
    else:
        sys.stdout.write(f"stack        {stack.name} ({stack.config.platform})\n{result.render()}\n")
        if args.candidates:
            sys.stdout.write(f"\n{render_candidates(result.candidates)}\n")
    return 0
