"""`specdeploy rollout`, `rollback` and `unlock`: blue/green traffic under a shift guard, the way back, the lock.

This module parses options, calls one function of ``infra.ops.release.wiring`` (which connects
the release machinery to the stack's platform) and prints what the operator must do next. boto3
and the release modules are imported only when a command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra.config import SLOTS
from infra.ops.cli.main import CommandError

if TYPE_CHECKING:
    from infra.config import StackFile
    from infra.ops.release.lock import Holder
    from infra.ops.release.rollout import Outcome, Release
    from infra.ops.release.targets import TargetOptions
    from infra.ops.release.wiring import Session

DEFAULT_STATE_DIR = Path(".specdeploy") / "release"


def register(subparsers: Any) -> None:
    rollout = subparsers.add_parser(
        "rollout", help="shift traffic to the idle slot step by step under the shift guard; roll back on a breach",
        description="Check the idle slot is deployed and ready, launch-validate it alone (quick profile), shift "
                    "traffic step by step while watching the stack's alarms and the slot's error rate and P99, "
                    "roll back automatically on any breach; at the end update the stack file.",
    )
    rollout.add_argument("--stack", required=True, help="stack name, e.g. prod")
    rollout.add_argument("--to", required=True, choices=SLOTS, help="the slot to roll out")
    rollout.add_argument("--steps", default="10,50,100", help="percent on the new slot per step (default 10,50,100)")
    rollout.add_argument("--observe", default="10m", help="observe window per step, e.g. 30s, 10m (default 10m)")
    rollout.add_argument("--poll", default="10s", help="how often the guard checks within a window (default 10s)")
    rollout.add_argument("--min-requests", type=int, default=20,
                         help="requests a window needs before error rate and P99 are judged (default 20)")
    rollout.add_argument("--resume", action="store_true", help="continue an interrupted rollout from its last step")
    rollout.add_argument("--skip-validation", action="store_true",
                         help="do not run the launch validation (only if the slot was validated by hand)")
    rollout.add_argument("--slot-endpoint", action="append", default=[], metavar="URL",
                         help="base URL reaching the new slot alone (repeatable; default $SPECDEPLOY_<SLOT>_ENDPOINT, "
                              "else the slot's direct path from the stack outputs: on aws its slot listener)")
    rollout.add_argument("--validation-hosts", type=lambda v: [h for h in v.split(",") if h], metavar="SPECS",
                         help="testinfra backends of the new slot's hosts for the host checks, comma separated "
                              "(e.g. ssh://ubuntu@10.0.1.23)")
    rollout.add_argument("--report-dir", type=Path, help="launch validation report (default reports/release/...)")
    _add_target_options(rollout)
    rollout.set_defaults(func=_rollout)

    rollback = subparsers.add_parser(
        "rollback", help="move all traffic back to the previous slot at once (the listener or route only)",
        description="Move all traffic to the previous slot in one API call (the slot an interrupted rollout "
                    "started from; otherwise the idle slot, or the active one when a canary is committed) and "
                    "the alarm actions with it. No `pulumi up`, no other change. The stack file is left as it was "
                    "unless --record; `specdeploy release record` writes it later, as its own reviewed change.",
    )
    rollback.add_argument("--stack", required=True, help="stack name, e.g. prod")
    rollback.add_argument("--to", choices=SLOTS, help="the slot to return to (default: the previous one)")
    rollback.add_argument("--force", action="store_true",
                          help="roll back even when the previous slot reports nothing ready")
    rollback.add_argument("--record", action="store_true",
                          help="also write the new split into the stack file (default: print the diff only)")
    _add_target_options(rollback)
    rollback.set_defaults(func=_rollback)

    release = subparsers.add_parser("release", help="release bookkeeping: record the live traffic split")
    release_commands = release.add_subparsers(dest="release_command", required=True, metavar="COMMAND")
    record = release_commands.add_parser(
        "record", help="write the traffic split the listener/route has now into the stack file",
        description="Read the split the platform routes now (ALB listener weights, canary Ingress or HTTPRoute "
                    "weights), write it as specdeploy:release active/canary_weight into the stack file (nothing "
                    "else changes) and print the diff to commit. --check only compares: exit 1 when they differ, "
                    "e.g. before a `pulumi up` in CI.",
    )
    record.add_argument("--stack", required=True, help="stack name, e.g. prod")
    record.add_argument("--check", action="store_true", help="only compare; exit 1 when the stack file disagrees")
    _add_target_options(record)
    record.set_defaults(func=_record, command="release record")

    unlock = subparsers.add_parser(
        "unlock", help="show who holds a stack's release lock; with --force, break it (audited)",
        description="Show who holds the stack's release lock (the S3 object in the model bucket on aws, the "
                    "Lease specdeploy-release on kubernetes) and until when. With --force, remove it: for a "
                    "holder that crashed or lost its network. A live holder notices at its next step and "
                    "stops before moving traffic. The break is written to the audit trail.",
    )
    unlock.add_argument("--stack", required=True, help="stack name, e.g. prod")
    unlock.add_argument("--force", action="store_true", help="break the lock, whoever holds it")
    unlock.add_argument("--reason", default="", help="why, recorded in the audit trail")
    _add_target_options(unlock)
    unlock.set_defaults(func=_unlock)


def _add_target_options(parser: argparse.ArgumentParser) -> None:
    aws = parser.add_argument_group("aws (default: the stack's outputs when a Pulumi CLI is installed)")
    aws.add_argument("--listener-arn", help="ALB listener with the weighted forward (or $SPECDEPLOY_LISTENER_ARN)")
    aws.add_argument("--target-group", action="append", default=[], metavar="SLOT=ARN",
                     help="target group of a slot, e.g. green=arn:... (or $SPECDEPLOY_<SLOT>_TARGET_GROUP_ARN)")
    aws.add_argument("--alarm", action="append", default=[], metavar="NAME", help="alarm to watch (repeatable)")
    aws.add_argument("--alarm-prefix", help="the stack's alarms are PREFIX<RuleName> (default '<stack>-', "
                                            "or $SPECDEPLOY_ALARM_PREFIX)")
    aws.add_argument("--region", help="AWS region (default: the stack's aws:region)")
    k8s = parser.add_argument_group("kubernetes")
    k8s.add_argument("--namespace", help="namespace of the slots (default: the stack's kubernetes.namespace)")
    k8s.add_argument("--kubeconfig", help="kubeconfig file (default $KUBECONFIG, ~/.kube/config, or in-cluster)")
    k8s.add_argument("--context", dest="kube_context", help="kubeconfig context (default: current)")
    k8s.add_argument("--prometheus-url", help="Prometheus whose alerts guard the rollout ($SPECDEPLOY_PROMETHEUS_URL)")
    lock = parser.add_argument_group("release lock and audit trail")
    lock.add_argument("--lock-bucket", help="aws: bucket of the lock and audit objects (default $SPECDEPLOY_RELEASE_"
                                            "BUCKET, else the stack's model bucket)")
    lock.add_argument("--lock-lease", default="2m", help="lease of the lock, renewed every third of it while the "
                                                         "command runs; a crashed holder frees it after (default 2m)")
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR,
                        help="rollout state and JSON-lines step log (default .specdeploy/release)")
    parser.add_argument("--stacks-dir", type=Path, help=argparse.SUPPRESS)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _rollout(args: argparse.Namespace) -> int:
    """0 when the new slot took all the traffic, 1 when it was rolled back."""
    from infra.ops.release import wiring
    from infra.ops.release.model import ReleaseError, parse_duration, parse_steps

    try:
        schedule = wiring.Schedule(parse_steps(args.steps), parse_duration(args.observe), parse_duration(args.poll),
                                   observe=args.observe, min_requests=args.min_requests)
        validation = wiring.Validation(args.skip_validation, args.validation_hosts, args.report_dir)
        session = _session(args)
        release, outcome = wiring.rollout(session, args.to, schedule, validation, resume=args.resume)
    except ReleaseError as exc:
        raise CommandError(str(exc)) from None
    except _cloud_errors() as exc:
        raise CommandError(f"AWS API: {exc}") from None
    return _report_rollout(session.stack, release, outcome, args.to)


def _report_rollout(stack: StackFile, release: Release, outcome: Outcome, slot: str) -> int:
    if not outcome.ok:
        _say(f"{'rolled back' if outcome.rolled_back else 'stopped before any traffic moved'}: {outcome.reason}")
        _say(f"all traffic is on {outcome.active} ({_weights(outcome.weights)}); details in {release.log.path}")
        _print_commit(stack, outcome, f"release({stack.name}): {outcome.active} stays active, {slot} rolled back")
        return 1
    _say(f"rollout complete: {_weights(outcome.weights)}")
    _print_commit(stack, outcome, f"release({stack.name}): {outcome.active} active")
    return 0


def _rollback(args: argparse.Namespace) -> int:
    from infra.ops.release import wiring
    from infra.ops.release.model import ReleaseError

    try:
        session = _session(args)
        stack = session.stack
        release, outcome = wiring.rollback(session, args.to, force=args.force, record=args.record)
    except ReleaseError as exc:
        raise CommandError(str(exc)) from None
    except _cloud_errors() as exc:
        raise CommandError(f"AWS API: {exc}") from None
    _say(f"rolled back: all traffic on {outcome.active} ({_weights(outcome.weights)}) via {release.router.description}")
    if args.record:
        _print_commit(stack, outcome, f"release({stack.name}): roll back to {outcome.active}")
    else:
        _say(f"the stack file still says the old split; record it when ready: specdeploy release record "
             f"--stack {stack.name}")
    return 0


def _record(args: argparse.Namespace) -> int:
    """Write (or with --check, compare) the live split into the stack file; 1 when --check finds a difference."""
    from infra.ops.release import wiring
    from infra.ops.release.model import ReleaseError

    try:
        session = _session(args)
        stack = session.stack
        if args.check:
            release, weights, agrees = wiring.check_record(session)
            if agrees:
                _say(f"{stack.path.name} agrees with {release.router.description}: {_weights(weights)}")
                return 0
            _say(f"{stack.path.name} disagrees with {release.router.description} ({_weights(weights)}): "
                 f"run specdeploy release record --stack {stack.name}")
            return 1
        release, outcome, diff = wiring.record(session)
    except ReleaseError as exc:
        raise CommandError(str(exc)) from None
    except _cloud_errors() as exc:
        raise CommandError(f"AWS API: {exc}") from None
    if diff:
        sys.stdout.write(diff)
    _print_commit(stack, outcome, f"release({stack.name}): record {_weights(outcome.weights)}")
    return 0


def _cloud_errors() -> tuple[type[Exception], ...]:
    """botocore's errors (no credentials, access denied, unreachable endpoint), when boto3 is in use."""
    if "botocore" not in sys.modules:
        return ()
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError)


def _load(args: argparse.Namespace) -> StackFile:
    from infra.config import load_stack
    from serving.config import ConfigError

    try:
        return load_stack(args.stack, args.stacks_dir)
    except ConfigError as exc:
        raise CommandError(str(exc)) from None


def _options(args: argparse.Namespace) -> TargetOptions:
    from infra.ops.release.targets import TargetOptions, parse_target_groups

    return TargetOptions(
        listener_arn=args.listener_arn,
        target_groups=parse_target_groups(args.target_group),
        alarm_names=args.alarm,
        alarm_prefix=args.alarm_prefix,
        region=args.region,
        slot_endpoints=getattr(args, "slot_endpoint", []),
        namespace=args.namespace,
        kubeconfig=args.kubeconfig,
        kube_context=args.kube_context,
        prometheus_url=args.prometheus_url,
        lock_bucket=args.lock_bucket,
    )


def _session(args: argparse.Namespace) -> Session:
    from infra.ops.release.wiring import Session

    stack = _load(args)
    return Session(stack, _options(args), args.state_dir, _holder(args, stack.name), _say)


def _holder(args: argparse.Namespace, stack: str) -> Holder:
    from infra.ops.release.lock import me
    from infra.ops.release.model import parse_duration

    command = f"specdeploy {args.command} --stack {stack}" + (f" --to {args.to}" if getattr(args, "to", None) else "")
    return me(command, parse_duration(args.lock_lease))


def _unlock(args: argparse.Namespace) -> int:
    """0 when the lock is free (or was broken with --force), 1 when it is held and --force was not given."""
    from infra.ops.release import lock, wiring
    from infra.ops.release.model import ReleaseError
    from infra.ops.release.state import StepLog

    try:
        session = _session(args)
        stack = session.stack
        backend, audit = wiring.lock_of(session)
        current = backend.read()
        if current is None:
            _say(f"{backend.where}: free")
            return 0
        holder = current[0]
        state = "expired" if holder.expired() else "live"
        _say(f"{backend.where}: held by {holder.describe()} ({state})")
        if not args.force:
            _say(f"break it (audited) with: specdeploy unlock --stack {stack.name} --force --reason '...'")
            return 1
        me = session.holder
        log = StepLog(session.log_path, stack.name, audit, by=f"{me.holder} pid {me.pid}")
        try:
            broken = lock.break_lock(backend, me, log.write, args.reason or "unlock --force")
        except lock.Conflict:
            raise ReleaseError(f"{backend.where} changed while it was being broken (renewed or released); "
                               "nothing removed: run unlock again to see who holds it now") from None
    except ReleaseError as exc:
        raise CommandError(str(exc)) from None
    except _cloud_errors() as exc:
        raise CommandError(f"AWS API: {exc}") from None
    if broken is not None:
        _say(f"broke the lock of {broken.describe()}; recorded in {audit.where}")
        if not broken.expired():
            _say("its lease was live: that process stops before its next traffic step")
    return 0


def _weights(weights: dict[str, int]) -> str:
    return ", ".join(f"{slot} {percent}%" for slot, percent in sorted(weights.items()))


def _print_commit(stack: StackFile, outcome: Outcome, message: str) -> None:
    path = stack.path
    try:
        shown = path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        shown = path
    if not outcome.stack_file_changed:
        _say(f"{shown} already says so; nothing to commit")
        return
    _say(f"{shown} updated (specdeploy:release only). Commit it so the next `pulumi up` agrees:")
    _say(f"  git add {shown} && git commit -m \"{message}\"")
