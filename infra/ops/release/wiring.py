"""The release commands wired to a stack's platform: one function per command.

ALB listener + CloudWatch alarms + an S3 lock on aws; ingress-nginx canary Ingresses or a Gateway
API HTTPRoute + Prometheus alerts + a Lease on kubernetes. Each function takes a
:class:`Session` (the stack, the operator's target options, where state is kept, who holds the
lock) and returns what happened; ``specdeploy rollout``, ``rollback``, ``release record`` and
``unlock`` (infra/ops/cli/release_cmd.py) only parse arguments, call one of them and print.
boto3 and the Kubernetes client are imported only when a function needs them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra.config import SLOTS, StackFile
from infra.ops.release.model import ReleaseError, Weights

if TYPE_CHECKING:
    from infra.ops.release.audit import AuditSink
    from infra.ops.release.aws import CloudWatchAlarms
    from infra.ops.release.guard import ShiftGuard, SlotMetrics
    from infra.ops.release.lock import Holder, LockBackend
    from infra.ops.release.rollout import Outcome, Release
    from infra.ops.release.targets import TargetOptions
    from infra.ops.release.traffic import AlarmActions, AlarmSource

Say = Callable[[str], None]  # progress lines for the operator


@dataclass(frozen=True)
class Session:
    """What every release command starts from."""

    stack: StackFile
    options: TargetOptions
    state_dir: Path  # rollout state and the JSON-lines step log
    holder: Holder  # who takes the release lock, and for how long
    say: Say

    @property
    def log_path(self) -> Path:
        return self.state_dir / f"{self.stack.name}.jsonl"


@dataclass(frozen=True)
class Schedule:
    """How a rollout moves: percent on the new slot per step, the observe window, the poll interval."""

    steps: list[int]
    observe_s: float
    poll_s: float
    observe: str  # the window as the operator wrote it, for the opening line
    min_requests: int = 20  # requests a window needs before error rate and P99 are judged


@dataclass(frozen=True)
class Validation:
    """The launch validation of the new slot before any traffic moves."""

    skip: bool = False
    hosts: Sequence[str] | None = None  # testinfra backends of the new slot's hosts
    report_dir: Path | None = None  # default reports/release/<stack>-<slot>-<time>


def rollout(session: Session, to: str, schedule: Schedule, validation: Validation,
            resume: bool = False) -> tuple[Release, Outcome]:
    """Connect, guard the shift, validate the new slot, move traffic step by step; an interrupt leaves
    traffic where it is."""
    import time

    from infra.ops.release import rollout as orchestration
    from infra.ops.release import validation as launch

    stack = session.stack
    release, alarms, endpoints = connect(session, slot=to, with_alarms=True)
    endpoints = endpoints or release.router.slot_status(to).endpoints
    guard = shift_guard(session, release, alarms, slot_metrics(session, release, to, endpoints), schedule)
    session.say(f"rollout {stack.name}: {to} in steps {','.join(map(str, schedule.steps))}% observing "
                f"{schedule.observe} each via {release.router.description}; log {release.log.path}")
    validator = None if validation.skip else launch.launch_validator(validation.hosts)
    report_dir = validation.report_dir or Path("reports") / "release" / f"{stack.name}-{to}-{int(time.time())}"
    try:
        outcome = orchestration.rollout(release, to, schedule.steps, schedule.observe_s, guard, validator,
                                        endpoints, report_dir, resume=resume)
    except KeyboardInterrupt:
        release.log.write("interrupted", slot=to)
        session.say(f"interrupted; traffic stays where it is. Continue: specdeploy rollout --stack {stack.name} "
                    f"--to {to} --resume   or go back: specdeploy rollback --stack {stack.name}")
        raise
    return release, outcome


def rollback(session: Session, to: str | None, force: bool = False, record: bool = False) -> tuple[Release, Outcome]:
    """All traffic back to the previous slot (or ``to``) in one call."""
    from infra.ops.release import rollout as orchestration

    release, _, _ = connect(session, slot=None, with_alarms=False)
    return release, orchestration.rollback(release, to, force=force, record=record)


def record(session: Session) -> tuple[Release, Outcome, str]:
    """Write the split the platform routes now into the stack file; the outcome and the diff."""
    from infra.ops.release import rollout as orchestration

    release, _, _ = connect(session, slot=None, with_alarms=False)
    outcome, diff = orchestration.record(release)
    return release, outcome, diff


def check_record(session: Session) -> tuple[Release, Weights, bool]:
    """The split the platform routes now, and whether the stack file already says so."""
    from infra.ops.release.rollout import routed_release
    from infra.ops.release.stackfile import render_release

    stack = session.stack
    release, _, _ = connect(session, slot=None, with_alarms=False)
    weights = release.router.weights()
    text = stack.path.read_text(encoding="utf-8")
    wanted = render_release(text, routed_release(stack.config.slots, weights), source=str(stack.path))
    return release, weights, wanted == text


def lock_of(session: Session) -> tuple[LockBackend, AuditSink]:
    """The stack's release lock and audit trail, without connecting to its traffic."""
    from infra.ops.release import targets

    if session.stack.config.platform == "local":
        raise ReleaseError(f"stack {session.stack.name} is platform local: its only lock is the flock under "
                           f"{session.state_dir}")
    backend, audit, _ = coordination(session.stack, session.options, targets.stack_outputs(session.stack.name),
                                     targets.environ())
    return backend, audit


def connect(session: Session, slot: str | None, with_alarms: bool) -> tuple[Release, AlarmSource | None, list[str]]:
    """The stack's router, alarm source and slot endpoints, from options, environment and stack outputs."""
    from infra.ops.release import targets
    from infra.ops.release.lock import SharedLock
    from infra.ops.release.rollout import Release
    from infra.ops.release.state import StateStore, StepLog

    stack, options, say = session.stack, session.options, session.say
    platform = stack.config.platform
    if platform == "local":
        raise ReleaseError(f"stack {stack.name} is platform local: one server, no blue/green slots to shift between")
    env = targets.environ()
    outputs = targets.stack_outputs(stack.name)
    backend, audit, api = coordination(stack, options, outputs, env)
    holder = session.holder
    log = StepLog(session.log_path, stack.name, audit, by=f"{holder.holder} pid {holder.pid}")
    alarms: AlarmSource | None = None
    alarm_actions: AlarmActions | None = None
    if platform == "aws":
        from infra.ops.release import aws

        region = options.region or stack.providers.get("aws:region")
        elbv2 = aws.client("elbv2", region)
        router: Any = aws.AlbRouter(elbv2, targets.listener_arn(options, outputs, env),
                                    targets.target_groups(options, outputs, env),
                                    slot_endpoints=outputs.get(targets.OUT_SLOT_ENDPOINTS) or {})
        cloudwatch_alarms = cloudwatch_alarms_of(stack, options, outputs, env, aws.client("cloudwatch", region),
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
            log.write("alarm_check_off", reason="no Prometheus URL")
            say("warning: no --prometheus-url: the stack's alerts are not watched, only the slot's metrics")
    if alarms is not None:
        log.write("alarms", watched=alarms.watched())
    shared = SharedLock(backend, holder, log.write)
    release = Release(stack, router, StateStore(session.state_dir, stack.name, shared), log, say=say,
                      alarm_actions=alarm_actions)
    endpoints = targets.slot_endpoints(slot, options, env, outputs) if slot else []
    if slot and not endpoints and platform == "kubernetes" and stack.config.slots.gate_cidrs:
        # The NetworkPolicy admits release.gate_cidrs to the pods' server port: reach the slot on their addresses.
        endpoints = router.pod_endpoints(slot, stack.config.service.port)
        log.write("slot_path", slot=slot, endpoints=endpoints, via="pod addresses (NetworkPolicy slot-path rule)")
    return release, alarms, endpoints


def slot_metrics(session: Session, release: Release, slot: str, endpoints: list[str]) -> SlotMetrics | None:
    """Where the shift guard reads the new slot's /metrics (error rate, P99); None turns that check off."""
    from infra.ops.release.guard import SlotMetrics, http_fetch
    from infra.ops.release.kubernetes import HttpRouteRouter, IngressCanaryRouter

    stack = session.stack
    if endpoints:
        return SlotMetrics(endpoints, http_fetch(os.environ.get("SPECDEPLOY_API_KEY")))
    router = release.router
    if isinstance(router, IngressCanaryRouter | HttpRouteRouter) and not stack.config.service.metrics_require_auth:
        # No port-forward needed: read every pod of the slot through the API server's proxy.
        port = stack.config.service.port
        release.log.write("metrics_via_api_proxy", slot=slot)
        return SlotMetrics(lambda: router.pod_proxies(slot, port), router.api.get_text)
    release.log.write("metrics_check_off", slot=slot, reason="no endpoint reaches the slot alone")
    session.say(f"warning: no endpoint for {slot}: error-rate/P99 check off, alarms only (pass --slot-endpoint)")
    return None


def shift_guard(session: Session, release: Release, alarms: AlarmSource | None, metrics: SlotMetrics | None,
                schedule: Schedule) -> ShiftGuard:
    from infra.ops.release.guard import ShiftGuard, ShiftLimits

    return ShiftGuard(alarms, metrics, ShiftLimits.from_stack(session.stack.config, schedule.min_requests),
                      release.log, poll_s=schedule.poll_s, say=session.say)


def coordination(stack: StackFile, options: TargetOptions, outputs: dict[str, Any],
                 env: Any) -> tuple[LockBackend, AuditSink, Any]:
    """The stack's shared lock and audit trail: S3 objects in its bucket, or a Lease and ConfigMap in its
    namespace; and the Kubernetes API client (None on aws)."""
    from infra.ops.release import audit, lock

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


def cloudwatch_alarms_of(stack: StackFile, options: TargetOptions, outputs: dict[str, Any], env: Any,
                         cloudwatch: Any, check: bool = True) -> CloudWatchAlarms:
    """The stack's alarms by slot (stack outputs, --alarm, or ``<prefix><slot>-<Rule>`` for the defined slots);
    ``check``: every one must exist (the shift guard reads them)."""
    from infra.alerts import alert_rules
    from infra.ops.release import aws, targets

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
