"""A `pulumi up` simulated from two recordings of the program (infra/ops/preview.py).

Pulumi compares each resource's new inputs with its state and updates the inputs that
differ, except those in ``ignore_changes``. Without ``--refresh`` the state is what the
previous `up` recorded (the program's inputs back then); with ``--refresh`` it is first
read back from the cloud. :func:`planned_updates` computes those updates; tests apply the
ones that touch traffic or paging to moto, the way the engine would.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infra.ops.preview import PreviewResult, RecordedResource

LISTENER = "aws:lb/listener:Listener"
ALARM = "aws:cloudwatch/metricAlarm:MetricAlarm"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"


def planned_updates(state: PreviewResult, program: PreviewResult,
                    refreshed: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """``"<type> <name>" -> {input: new value}`` for every resource whose inputs the update would change.

    ``refreshed``: ``"<type> <name>" -> {input: live value}`` read back from the cloud (``--refresh``);
    those inputs replace the recorded state before the comparison.
    """
    before = {_key(r): r for r in state.resources if r.custom}
    updates: dict[str, dict[str, Any]] = {}
    for resource in program.resources:
        if not resource.custom:
            continue
        old = before.get(_key(resource))
        if old is None:
            updates[_key(resource)] = dict(resource.inputs)  # a create
            continue
        current = {**old.inputs, **((refreshed or {}).get(_key(resource)) or {})}
        changed = {k: v for k, v in resource.inputs.items()
                   if k not in resource.ignore_changes and current.get(k) != v}
        if changed:
            updates[_key(resource)] = changed
    return updates


def key(resource_type: str, name: str) -> str:
    return f"{resource_type} {name}"


def _key(resource: RecordedResource) -> str:
    return key(resource.type, resource.name)
