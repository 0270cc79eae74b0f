"""Where a stack's release machinery lives: ARNs, namespace, alarm names, slot endpoints.

One lookup order for every value: the command-line option, then the environment,
then the stack's outputs (``pulumi stack output --json``, only when a Pulumi CLI is
installed). Explicit beats discovered, and a missing value is an error that names
the option to pass.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from infra.config import project_dir
from infra.ops.release.model import SLOTS, ReleaseError

# Stack outputs read here (exported by infra/__main__.py).
OUT_LISTENER_ARN = "listener_arn"
OUT_TARGET_GROUP_ARNS = "target_group_arns"  # {"blue": arn, "green": arn}
OUT_ALARM_NAMES = "alarm_names"  # AWS: CloudWatch alarm names
OUT_ALERT_NAMES = "alert_names"  # Kubernetes: PrometheusRule alert names
OUT_NAMESPACE = "namespace"
OUT_SLOT_ENDPOINTS = "gate_endpoints"  # AWS: {"blue": url, "green": url}, each slot's listener on the ALB

ENV_LISTENER_ARN = "SPECDEPLOY_LISTENER_ARN"
ENV_TARGET_GROUP_ARN = "SPECDEPLOY_{SLOT}_TARGET_GROUP_ARN"
ENV_SLOT_ENDPOINT = "SPECDEPLOY_{SLOT}_ENDPOINT"  # comma-separated base URLs reaching one slot alone
ENV_ALARM_PREFIX = "SPECDEPLOY_ALARM_PREFIX"
ENV_PROMETHEUS_URL = "SPECDEPLOY_PROMETHEUS_URL"


@dataclass(frozen=True)
class TargetOptions:
    """What the operator passed on the command line (None / empty = not given)."""

    listener_arn: str | None = None
    target_groups: Mapping[str, str] = field(default_factory=dict)
    alarm_names: Sequence[str] = ()
    alarm_prefix: str | None = None
    region: str | None = None
    slot_endpoints: Sequence[str] = ()
    namespace: str | None = None
    kubeconfig: str | None = None
    kube_context: str | None = None
    prometheus_url: str | None = None
    lock_bucket: str | None = None  # aws: bucket of the release lock and audit trail


def stack_outputs(stack: str) -> dict[str, Any]:
    """``pulumi stack output --json`` of the stack, or {} when no Pulumi CLI is installed."""
    pulumi = shutil.which("pulumi")
    if pulumi is None:
        return {}
    result = subprocess.run([pulumi, "stack", "output", "--json", "--stack", stack], cwd=project_dir(),
                            capture_output=True, text=True, check=False, timeout=120)
    if result.returncode != 0:
        raise ReleaseError(f"pulumi stack output --stack {stack} failed: {result.stderr.strip()[:300]}")
    outputs: dict[str, Any] = json.loads(result.stdout or "{}")
    return outputs


def parse_target_groups(values: Sequence[str]) -> dict[str, str]:
    """``["blue=arn:…", "green=arn:…"]`` -> {"blue": "arn:…", "green": "arn:…"}."""
    groups: dict[str, str] = {}
    for value in values:
        slot, sep, arn = value.partition("=")
        if not sep or slot not in SLOTS or not arn:
            raise ReleaseError(f"--target-group {value!r}: expected SLOT=ARN with SLOT blue or green")
        groups[slot] = arn
    return groups


def listener_arn(options: TargetOptions, outputs: Mapping[str, Any], env: Mapping[str, str]) -> str:
    value = options.listener_arn or env.get(ENV_LISTENER_ARN) or outputs.get(OUT_LISTENER_ARN)
    if not value:
        raise ReleaseError(f"no listener ARN: pass --listener-arn or set {ENV_LISTENER_ARN} "
                           "(read from the stack outputs when a Pulumi CLI is installed)")
    return str(value)


def target_groups(options: TargetOptions, outputs: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    from_outputs = outputs.get(OUT_TARGET_GROUP_ARNS) or {}
    groups: dict[str, str] = {}
    for slot in SLOTS:
        env_name = ENV_TARGET_GROUP_ARN.format(SLOT=slot.upper())
        value = options.target_groups.get(slot) or env.get(env_name) or from_outputs.get(slot)
        if not value:
            raise ReleaseError(f"no target group ARN for {slot}: pass --target-group {slot}=ARN or set {env_name}")
        groups[slot] = str(value)
    return groups


def slot_endpoints(slot: str, options: TargetOptions, env: Mapping[str, str],
                   outputs: Mapping[str, Any] | None = None) -> list[str]:
    """Base URLs reaching ``slot`` alone: --slot-endpoint, $SPECDEPLOY_<SLOT>_ENDPOINT, else the slot's
    direct path from the stack outputs (AWS: its slot listener on the load balancer)."""
    if options.slot_endpoints:
        return [e.rstrip("/") for e in options.slot_endpoints]
    raw = env.get(ENV_SLOT_ENDPOINT.format(SLOT=slot.upper()), "")
    listed = [e.strip().rstrip("/") for e in raw.split(",") if e.strip()]
    if listed:
        return listed
    direct = ((outputs or {}).get(OUT_SLOT_ENDPOINTS) or {}).get(slot)
    return [str(direct).rstrip("/")] if direct else []


def alarm_names(options: TargetOptions, outputs: Mapping[str, Any], key: str) -> dict[str, list[str]] | None:
    """Explicit alarm names by slot ("" for names given without one), or None when they must be discovered.

    The AWS stack exports ``{slot: [names]}``; a flat list (older stacks, --alarm) is kept under "".
    """
    if options.alarm_names:
        return {"": list(options.alarm_names)}
    listed = outputs.get(key)
    if not listed:
        return None
    if isinstance(listed, Mapping):
        return {str(slot): [str(n) for n in names] for slot, names in listed.items()}
    return {"": [str(n) for n in listed]}


def environ() -> Mapping[str, str]:
    return os.environ
