"""`specdeploy config validate|show|reference`: check and inspect stack files."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from infra.ops.cli.main import CommandError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("config", help="validate and inspect stack configuration")
    actions = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)

    validate = actions.add_parser("validate", help="validate stacks/Pulumi.<stack>.yaml (all stacks by default)")
    validate.add_argument("--stack", help="stack name, e.g. prod; default: every stack in stacks/")
    validate.add_argument("--stacks-dir", type=Path, help=argparse.SUPPRESS)
    validate.set_defaults(func=_validate)

    show = actions.add_parser("show", help="print the resolved config of a stack, secrets masked")
    show.add_argument("--stack", required=True, help="stack name")
    show.add_argument("--format", choices=("yaml", "json"), default="yaml")
    show.add_argument("--server-config", action="store_true",
                      help="print the server config file rendered from the stack instead")
    show.add_argument("--stacks-dir", type=Path, help=argparse.SUPPRESS)
    show.set_defaults(func=_show)

    reference = actions.add_parser("reference", help="regenerate docs/config-reference.md and Pulumi.yaml config")
    reference.add_argument("--check", action="store_true", help="exit 1 if either file is stale")
    reference.set_defaults(func=_reference)


def _validate(args: argparse.Namespace) -> int:
    from infra.config import ConfigError, available_stacks, load_stack

    names = [args.stack] if args.stack else available_stacks(args.stacks_dir)
    if not names:
        raise CommandError("no stack files found in stacks/")
    failed = 0
    for name in names:
        try:
            stack = load_stack(name, args.stacks_dir)
        except ConfigError as exc:
            failed += 1
            sys.stderr.write(f"FAIL {name}\n{exc}\n")
            continue
        sys.stdout.write(f"ok   {name} ({stack.config.platform}, {stack.path.name})\n")
    return 1 if failed else 0


def _show(args: argparse.Namespace) -> int:
    from infra.config import ConfigError, load_stack, masked_dump, render_server_config

    try:
        stack = load_stack(args.stack, args.stacks_dir)
    except ConfigError as exc:
        raise CommandError(str(exc)) from exc
    data: dict[str, Any]
    if args.server_config:
        data = render_server_config(stack.config).model_dump(mode="json")
    else:
        data = {"stack": stack.name, "providers": stack.providers, "config": masked_dump(stack.config)}
    if args.format == "json":
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        sys.stdout.write(yaml.safe_dump(data, sort_keys=False))
    return 0


def _reference(args: argparse.Namespace) -> int:
    from infra.config.reference import write_or_check

    stale = write_or_check(check=args.check)
    for path in stale:
        sys.stderr.write(f"stale: {path} (run `specdeploy config reference`)\n" if args.check else f"wrote {path}\n")
    return 1 if (stale and args.check) else 0
