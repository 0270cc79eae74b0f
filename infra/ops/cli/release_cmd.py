"""`specdeploy rollout`, `rollback` and `unlock`: blue/green traffic with gates, the way back, the lock.

The machinery lives in ``infra.ops.release``; this module parses options, connects it
to the stack's platform (ALB + CloudWatch on aws, ingress-nginx or a Gateway API HTTPRoute +
Prometheus on kubernetes) and prints what the operator must do next. boto3 and the release
modules are imported only when a command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra.config import SLOTS
from infra.ops.cli.main import CommandError

if TYPE_CHECKING:
    from infra.config import StackFile
    from infra.ops.release.audit import AuditSink
    from infra.ops.release.aws import CloudWatchAlarms
    from infra.ops.release.gates import GateWatcher, SlotMetrics
    from infra.ops.release.lock import Holder, LockBackend
    from infra.ops.release.rollout import Outcome, Release
    from infra.ops.release.targets import TargetOptions
    from infra.ops.release.traffic import AlarmActions, AlarmSource

DEFAULT_STATE_DIR = Path(".specdeploy") / "release"


def register(subparsers: Any) -> None:
    rollout = subparsers.add_parser(
        "rollout", help="shift traffic to the idle slot step by step, watching gates; roll back on a breach",
        description="Check the idle slot is deployed and ready, launch-validate it alone (quick profile), shift "
                    "traffic step by step while watching the stack's alarms and the slot's error rate and P99, "
                    "roll back automatically on any breach; at the end update the stack file.",
    )
    rollout.add_argument("--stack", required=True, help="stack name, e.g. prod")
    rollout.add_argument("--to", required=True, choices=SLOTS, help="the slot to roll out")
    rollout.add_argument("--steps", default="10,50,100", help="percent on the new slot per step (default 10,50,100)")
    rollout.add_argument("--observe", default="10m", help="observe window per step, e.g. 30s, 10m (default 10m)")
    rollout.add_argument("--poll", default="10s", help="how often gates are checked within a window (default 10s)")
    rollout.add_argument("--min-requests", type=int, default=20,
                         help="requests a window needs before error rate and P99 are judged (default 20)")
    rollout.add_argument("--resume", action="store_true", help="continue an interrupted rollout from its last step")
    rollout.add_argument("--skip-validation", action="store_true",
                         help="do not run the launch validation (only if the slot was validated by hand)")
    rollout.add_argument("--slot-endpoint", action="append", default=[], metavar="URL",
                         help="base URL reaching the new slot alone (repeatable; default $SPECDEPLOY_<SLOT>_ENDPOINT, "
                              "else the slot's gate path from the stack outputs: on aws its gate listener)")
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
    k8s.add_argument("--prometheus-url", help="Prometheus whose alerts gate the rollout ($SPECDEPLOY_PROMETHEUS_URL)")
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
    """Connect, watch gates, shift traffic; 0 when the new slot took it all, 1 when it was rolled back."""
    from infra.ops.release.model import ReleaseError

    try:
        steps, observe_s, poll_s = _schedule(args)
        stack = _load(args)
        release, alarms, endpoints = _connect(stack, _options(args), args, slot=args.to, with_alarms=True)
        endpoints = endpoints or release.router.slot_status(args.to).endpoints
        gates = _gates(stack, release, alarms, _slot_metrics(stack, release, args.to, endpoints), args, poll_s)
        _say(f"rollout {stack.name}: {args.to} in steps {','.join(map(str, steps))}% observing {args.observe} each "
             f"via {release.router.description}; log {release.log.path}")
        outcome = _shift(stack, release, gates, endpoints, steps, observe_s, args)
    except ReleaseError as exc:
        raise CommandError(str(exc)) from None
    except _cloud_errors() as exc:
        raise CommandError(f"AWS API: {exc}") from None
    return _report_rollout(stack, release, outcome, args.to)


def _schedule(args: argparse.Namespace) -> tuple[list[int], float, float]:
    """Percent per step, the observe window and the poll interval, from --steps, --observe and --poll."""
    from infra.ops.release.model import parse_duration, parse_steps

    return parse_steps(args.steps), parse_duration(args.observe), parse_duration(args.poll)


def _slot_metrics(stack: StackFile, release: Release, slot: str, endpoints: list[str]) -> SlotMetrics | None:
    """Where the error-rate and P99 gate reads the new slot's /metrics; None turns that gate off."""
    from infra.ops.release.gates import SlotMetrics, http_fetch
    from infra.ops.release.kubernetes import HttpRouteRouter, IngressCanaryRouter

    if endpoints:
        return SlotMetrics(endpoints, http_fetch(os.environ.get("SPECDEPLOY_API_KEY")))
    router = release.router
    if isinstance(router, IngressCanaryRouter | HttpRouteRouter) and not stack.config.service.metrics_require_auth:
        # No port-forward needed: read every pod of the slot through the API server's proxy.
        port = stack.config.service.port
        release.log.write("metrics_via_api_proxy", slot=slot)
        return SlotMetrics(lambda: router.pod_proxies(slot, port), router.api.get_text)
    release.log.write("metrics_gate_off", slot=slot, reason="no endpoint reaches the slot alone")
    _say(f"warning: no endpoint for {slot}: error-rate/P99 gate off, alarms only (pass --slot-endpoint)")
    return None


def _gates(stack: StackFile, release: Release, alarms: AlarmSource | None, metrics: SlotMetrics | None,
           args: argparse.Namespace, poll_s: float) -> GateWatcher:
    from infra.ops.release.gates import GateThresholds, GateWatcher

    return GateWatcher(alarms, metrics, GateThresholds.from_stack(stack.config, args.min_requests),
                       release.log, poll_s=poll_s, say=_say)


def _shift(stack: StackFile, release: Release, gates: GateWatcher, endpoints: list[str], steps: list[int],
           observe_s: float, args: argparse.Namespace) -> Outcome:
    """Validate the new slot, then move traffic step by step; an interrupt leaves traffic where it is."""
    from infra.ops.release import validation
    from infra.ops.release.rollout import rollout

    validator = None if args.skip_validation else validation.launch_validator(args.validation_hosts)
    report_dir = args.report_dir or Path("reports") / "release" / f"{stack.name}-{args.to}-{int(time.time())}"
    try:
        return rollout(release, args.to, steps, observe_s, gates, validator, endpoints, report_dir,
                       resume=args.resume)
    except KeyboardInterrupt:
        release.log.write("interrupted", slot=args.to)
        _say(f"interrupted; traffic stays where it is. Continue: specdeploy rollout --stack {stack.name} "
             f"--to {args.to} --resume   or go back: specdeploy rollback --stack {stack.name}")
        raise


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
    from infra.ops.release.model import ReleaseError
    from infra.ops.release.rollout import rollback

    try:
        stack = _load(args)
        release, _, _ = _connect(stack, _options(args), args, slot=None, with_alarms=False)
        outcome = rollback(release, args.to, force=args.force, record=args.record)
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
    from infra.ops.release.model import ReleaseError
    from infra.ops.release.rollout import record, routed_release
    from infra.ops.release.stackfile import render_release

    try:
        stack = _load(args)
        release, _, _ = _connect(stack, _options(args), args, slot=None, with_alarms=False)
        if args.check:
            weights = release.router.weights()
            text = stack.path.read_text(encoding="utf-8")
            wanted = render_release(text, routed_release(stack.config.slots, weights), source=str(stack.path))
            if wanted == text:
                _say(f"{stack.path.name} agrees with {release.router.description}: {_weights(weights)}")
                return 0
            _say(f"{stack.path.name} disagrees with {release.router.description} ({_weights(weights)}): "
                 f"run specdeploy release record --stack {stack.name}")
            return 1
        outcome, diff = record(release)
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


def _connect(stack: StackFile, options: TargetOptions, args: argparse.Namespace, slot: str | None,
             with_alarms: bool) -> tuple[Release, AlarmSource | None, list[str]]:
    """The stack's router, alarm source and slot endpoints, from options, environment and stack outputs."""
    from infra.ops.release import targets
    from infra.ops.release.model import ReleaseError
    from infra.ops.release.rollout import Release
    from infra.ops.release.state import StateStore, StepLog

    platform = stack.config.platform
    if platform == "local":
        raise ReleaseError(f"stack {stack.name} is platform local: one server, no blue/green slots to shift between")
    env = targets.environ()
    outputs = targets.stack_outputs(stack.name)
    backend, audit, api = _coordination(stack, options, outputs, env)
    holder = _holder(args, stack.name)
    log = StepLog(args.state_dir / f"{stack.name}.jsonl", stack.name, audit, by=f"{holder.holder} pid {holder.pid}")
    alarms: AlarmSource | None = None
    alarm_actions: AlarmActions | None = None
    if platform == "aws":
        from infra.ops.release import aws

        region = options.region or stack.providers.get("aws:region")
        elbv2 = aws.client("elbv2", region)
        router: Any = aws.AlbRouter(elbv2, targets.listener_arn(options, outputs, env),
                                    targets.target_groups(options, outputs, env),
                                    gate_endpoints=outputs.get(targets.OUT_GATE_ENDPOINTS) or {})
        cloudwatch_alarms = _cloudwatch_alarms(stack, options, outputs, env, aws.client("cloudwatch", region),
                                               check=with_alarms)
        alarm_actions = cloudwatch_alarms  # paging follows every shift, rollbacks included
        if with_alarms:
            alarms = cloudwatch_alarms
    else:
        from infra.ops.release import kubernetes

        spec = stack.config.kubernetes
        namespace = options.namespace or outputs.get(targets.OUT_NAMESPACE) or (spec.namespace if spec else None)
        router = kubernetes.router_for(spec.routing if spec else "ingress-nginx", api, str(namespace))
        alarm_actions = kubernetes.PrometheusTraffic(api, str(namespace))  # the alerts' live split
        prometheus = options.prometheus_url or env.get(targets.ENV_PROMETHEUS_URL)
        if with_alarms and prometheus:
            from infra.alerts import alert_rules

            listed = targets.alarm_names(options, outputs, targets.OUT_ALERT_NAMES)
            names = [n for group in listed.values() for n in group] if listed else \
                [rule.name for rule in alert_rules(stack.config)]
            alarms = kubernetes.PrometheusAlerts(prometheus, names)
        elif with_alarms:
            log.write("alarm_gate_off", reason="no Prometheus URL")
            _say("warning: no --prometheus-url: the stack's alerts are not watched, only the slot's metrics")
    if alarms is not None:
        log.write("alarms", watched=alarms.watched())
    from infra.ops.release.lock import SharedLock

    shared = SharedLock(backend, holder, log.write)
    release = Release(stack, router, StateStore(args.state_dir, stack.name, shared), log, say=_say,
                      alarm_actions=alarm_actions)
    endpoints = targets.slot_endpoints(slot, options, env, outputs) if slot else []
    if slot and not endpoints and platform == "kubernetes" and stack.config.slots.gate_cidrs:
        # The NetworkPolicy admits release.gate_cidrs to the pods' server port: gate on their addresses.
        endpoints = router.pod_endpoints(slot, stack.config.service.port)
        log.write("gate_path", slot=slot, endpoints=endpoints, via="pod addresses (NetworkPolicy gate rule)")
    return release, alarms, endpoints


def _coordination(stack: StackFile, options: TargetOptions, outputs: dict[str, Any],
                  env: Any) -> tuple[LockBackend, AuditSink, Any]:
    """The stack's shared lock and audit trail: S3 objects in its bucket, or a Lease and ConfigMap in its
    namespace; and the Kubernetes API client (None on aws)."""
    from infra.ops.release import audit, lock
    from infra.ops.release.model import ReleaseError

    if stack.config.platform == "aws":
        from infra.ops.release import aws

        bucket = options.lock_bucket or env.get("SPECDEPLOY_RELEASE_BUCKET") or outputs.get("model_bucket") \
            or _s3_bucket(stack.config.model.source)
        if not bucket:
            raise ReleaseError(f"no bucket for the release lock of {stack.name}: its model is not in S3; "
                               "pass --lock-bucket or set SPECDEPLOY_RELEASE_BUCKET")
        s3 = aws.client("s3", options.region or stack.providers.get("aws:region"))
        return lock.S3Lock(s3, str(bucket), stack.name), audit.S3Audit(s3, str(bucket), stack.name), None
    from infra.ops.release import kubernetes

    spec = stack.config.kubernetes
    namespace = str(options.namespace or outputs.get("namespace") or (spec.namespace if spec else "default"))
    api = kubernetes.KubeApi.from_environment(Path(options.kubeconfig) if options.kubeconfig else None,
                                              options.kube_context)
    return lock.KubeLease(api, namespace), audit.ConfigMapAudit(api, namespace), api


def _s3_bucket(uri: str) -> str | None:
    if not uri.startswith("s3://"):
        return None
    return uri.removeprefix("s3://").split("/", 1)[0] or None


def _holder(args: argparse.Namespace, stack: str) -> Holder:
    from infra.ops.release.lock import me
    from infra.ops.release.model import parse_duration

    command = f"specdeploy {args.command} --stack {stack}" + (f" --to {args.to}" if getattr(args, "to", None) else "")
    return me(command, parse_duration(args.lock_lease))


def _unlock(args: argparse.Namespace) -> int:
    """0 when the lock is free (or was broken with --force), 1 when it is held and --force was not given."""
    from infra.ops.release import lock, targets
    from infra.ops.release.model import ReleaseError
    from infra.ops.release.state import StepLog

    try:
        stack = _load(args)
        if stack.config.platform == "local":
            raise ReleaseError(f"stack {stack.name} is platform local: its only lock is the flock under "
                               f"{args.state_dir}")
        backend, audit, _ = _coordination(stack, _options(args), targets.stack_outputs(stack.name),
                                          targets.environ())
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
        me = _holder(args, stack.name)
        log = StepLog(args.state_dir / f"{stack.name}.jsonl", stack.name, audit, by=f"{me.holder} pid {me.pid}")
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


def _cloudwatch_alarms(stack: StackFile, options: TargetOptions, outputs: dict[str, Any], env: Any,
                       cloudwatch: Any, check: bool = True) -> CloudWatchAlarms:
    """The stack's alarms by slot (stack outputs, --alarm, or ``<prefix><slot>-<Rule>`` for the defined slots);
    ``check``: every one must exist (the gates read them)."""
    from infra.alerts import alert_rules
    from infra.ops.release import aws, targets
    from infra.ops.release.model import ReleaseError

    by_slot = targets.alarm_names(options, outputs, targets.OUT_ALARM_NAMES)
    if by_slot is None:
        prefix = options.alarm_prefix or env.get(targets.ENV_ALARM_PREFIX) or f"{stack.name}-"
        defined = [slot for slot in SLOTS if stack.config.slots.slot(slot) is not None]
        by_slot = aws.alarm_names(alert_rules(stack.config), prefix, defined)
    source = aws.CloudWatchAlarms(cloudwatch, by_slot.get("", []), by_slot)
    if not check:
        return source
    missing = source.missing()
    if missing:
        raise ReleaseError(f"alarm(s) not found in CloudWatch: {', '.join(missing)}; "
                           "pass --alarm NAME (repeatable) or --alarm-prefix")
    return source


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
