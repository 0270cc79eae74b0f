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
    parser.add_argument("--refresh-offerings", action="store_true",
                        help="ask EC2 (your AWS credentials) which zones of the stack's region offer the catalogued "
                        "types, and save the answer beside the stack files for later plans and reviews")
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
    zones = _zones(stack, result.instance.name, refresh=args.refresh_offerings)
    if args.json:
        sys.stdout.write(json.dumps({**result.as_dict(), "zones": zones[1]}, indent=2) + "\n")
    else:
        sys.stdout.write(f"stack        {stack.name} ({stack.config.platform})\n{result.render()}\n")
        if zones[0]:
            sys.stdout.write(zones[0] + "\n")
        if args.candidates:
            sys.stdout.write(f"\n{render_candidates(result.candidates)}\n")
    return 0


def _zones(stack: Any, instance_type: str, refresh: bool) -> tuple[str, list[str] | None]:
    """The plan's zones line and the zones (None: not known) for an aws stack."""
    from infra.catalog import instance_names
    from infra.offerings import fetch_offerings, load_offerings, offerings_path, render_zones, save_offerings

    if stack.config.platform != "aws":
        return "", None
    region = stack.providers.get("aws:region")
    if not region:
        raise CommandError(f"stack {stack.name!r}: aws:region is not set")
    path = offerings_path(stack.path.parent, region)
    if refresh:
        try:
            save_offerings(fetch_offerings(region, instance_names()), path)
        except Exception as exc:  # credentials, permissions, endpoint: name what failed
            raise CommandError(f"could not read instance offerings of {region}: {exc}") from exc
    try:
        offerings = load_offerings(path)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    hint = f"run `specdeploy plan --stack {stack.name} --refresh-offerings` with AWS credentials"
    line = render_zones(offerings, instance_type, region, hint)
    return line, (offerings.zones(instance_type) if offerings else None)
