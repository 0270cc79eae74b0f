"""`specdeploy preview --stack NAME`: every resource the stack would create, offline.

Runs infra/__main__.py under Pulumi's mocks engine (infra/preview.py): no CLI, no
cloud, no credentials. A review aid beside `pulumi preview --diff`, which shows the
real diff against the deployed state.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from infra.cli.main import CommandError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("preview", help="offline preview: every resource a stack would create, and the plan")
    parser.add_argument("--stack", required=True, help="stack name, e.g. prod")
    parser.add_argument("--json", action="store_true", help="resources and outputs as JSON")
    parser.add_argument("--stacks-dir", type=Path, help=argparse.SUPPRESS)
    parser.set_defaults(func=_preview)


def _preview(args: argparse.Namespace) -> int:
    from infra.capacity import CapacityError
    from infra.config import ConfigError, load_stack
    from infra.preview import record_stack, render

    try:
        if load_stack(args.stack, args.stacks_dir).config.platform == "local":
            raise CommandError(f"stack {args.stack!r} is platform local: `specdeploy up --stack {args.stack}` runs it")
        result = record_stack(args.stack, args.stacks_dir)
    except (ConfigError, CapacityError, ValueError, RuntimeError) as exc:
        raise CommandError(str(exc)) from exc
    if args.json:
        data = {"stack": result.stack, "resources": [asdict(r) for r in result.resources],
                "outputs": result.exports, "plan": result.plan_text}
        sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    else:
        sys.stdout.write(render(result) + "\n")
    return 0
