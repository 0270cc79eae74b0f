"""`specdeploy preview --stack NAME`: every resource the stack would create, offline.

Runs infra/__main__.py under Pulumi's mocks engine (infra/program/preview.py): no CLI, no
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

from infra.ops.cli.main import CommandError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("preview", help="offline preview: every resource a stack would create, and the plan")
    parser.add_argument("--stack", required=True, help="stack name, e.g. prod")
    parser.add_argument("--json", action="store_true", help="resources and outputs as JSON")
    parser.add_argument("--stacks-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--render-k8s", type=Path, metavar="DIR",
                        help="also write every Kubernetes object as YAML into DIR (platform kubernetes)")
    parser.add_argument("--against", metavar="GIT_REF",
                        help="name the changes since the stack file at GIT_REF (e.g. origin/main) that reach the "
                             "slots carrying traffic without a rollout")
    parser.set_defaults(func=_preview)


def _preview(args: argparse.Namespace) -> int:
    from infra.capacity import CapacityError
    from infra.config import ConfigError, load_stack
    from infra.policy.aws_policies import POLICIES
    from infra.policy.offline import check
    from infra.program.preview import record_stack, render

    try:
        if load_stack(args.stack, args.stacks_dir).config.platform == "local":
            raise CommandError(f"stack {args.stack!r} is platform local: `specdeploy up --stack {args.stack}` runs it")
        result = record_stack(args.stack, args.stacks_dir)
    except (ConfigError, CapacityError, ValueError, RuntimeError) as exc:
        raise CommandError(str(exc)) from exc
    violations = check(result.resources) if result.config.platform == "aws" else []
    live = _live_changes(args) if args.against else []
    if args.render_k8s is not None:
        _render_k8s(result, args.render_k8s)
    if args.json:
        data = {"stack": result.stack, "resources": [asdict(r) for r in result.resources],
                "outputs": result.exports, "plan": result.plan_text, "violations": [asdict(v) for v in violations],
                "live_changes": [asdict(c) for c in live]}
        sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
        return 1 if violations else 0
    sys.stdout.write(render(result) + "\n")
    if result.config.platform == "aws":
        summary = "no violations" if not violations else f"{len(violations)} violation(s)"
        sys.stdout.write(f"\npolicy pack: {len(POLICIES)} policies, {summary}\n")
        for v in violations:
            sys.stdout.write(f"  [{v.policy}] {v.message}\n")
    if args.against:
        _write_live_changes(args, live)
    return 1 if violations else 0


def _live_changes(args: argparse.Namespace) -> list[Any]:
    from infra.config import ConfigError, load_stack
    from infra.ops.live_changes import live_changes, stack_at

    stack = load_stack(args.stack, args.stacks_dir)
    try:
        return live_changes(stack_at(args.against, stack.path), stack.config)
    except (ConfigError, ValueError) as exc:
        raise CommandError(str(exc)) from exc


def _write_live_changes(args: argparse.Namespace, live: list[Any]) -> None:
    if not live:
        sys.stdout.write(f"\nagainst {args.against}: nothing changes on the slots carrying traffic\n")
        return
    sys.stdout.write(f"\nWARNING against {args.against}: these changes reach the slot(s) carrying traffic at "
                     "`pulumi up`, without a canary:\n")
    for change in live:
        sys.stdout.write(f"  {change.slot}: {change.describe()}\n")
    sys.stdout.write("  to canary them, put them on the idle slot (release.<idle>.server, or its image / "
                     "model_version) and `specdeploy rollout` (runbooks/rollout.md)\n")


# --- --render-k8s (Kubernetes platform, infra/ops/k8s_render.py) -----------------------------------

def _render_k8s(result: Any, directory: Path) -> None:
    """Write the recorded Kubernetes objects of `result` (a PreviewResult) as YAML, one file each."""
    from infra.ops.k8s_render import render_objects, write_manifests

    objects = render_objects((r.type, r.inputs) for r in result.resources if r.custom)
    if not objects:
        raise CommandError(f"stack {result.stack!r} (platform {result.config.platform}) has no Kubernetes objects")
    paths = write_manifests(objects, directory)
    sys.stderr.write(f"wrote {len(paths)} Kubernetes objects to {directory}\n")
