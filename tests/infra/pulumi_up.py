"""A `pulumi up` simulated from two recordings of the program (infra/program/preview.py).

Pulumi compares each resource's new inputs with its state and updates the inputs that
differ, except those in ``ignore_changes``. Without ``--refresh`` the state is what the
previous `up` recorded (the program's inputs back then); with ``--refresh`` it is first
read back from the cloud. :func:`planned_updates` computes those updates; tests apply the
ones that touch traffic or paging to moto, the way the engine would.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

from infra.program.preview import PreviewResult, RecordedResource

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
                   if k not in resource.ignore_changes
                   and _without(current.get(k), k, resource.ignore_changes) != _without(v, k, resource.ignore_changes)}
        if changed:
            updates[_key(resource)] = changed
    return updates


_STEP = re.compile(r'\.?([A-Za-z_][A-Za-z0-9_]*)|\[\*\]|\["([^"]+)"\]|\[(\d+)\]')


def parse_path(path: str) -> list[str | int | None]:
    """A Pulumi property path (``spec.rules[*].backendRefs``, ``metadata.annotations["a/b"]``) as steps:
    a key, a list index, or None for ``[*]`` (every element)."""
    steps: list[str | int | None] = []
    pos = 0
    while pos < len(path):
        match = _STEP.match(path, pos)
        if match is None:
            raise ValueError(f"not a property path: {path!r} (at {path[pos:]!r})")
        name, quoted, index = match.groups()
        steps.append(name if name is not None else quoted if quoted is not None else
                     int(index) if index is not None else None)
        pos = match.end()
    return steps


def _without(value: Any, top: str, ignored: tuple[str, ...]) -> Any:
    """``value`` (the input ``top``) with every nested ignore_changes path under ``top`` removed."""
    result = copy.deepcopy(value)
    for path in ignored:
        steps = parse_path(path)
        if len(steps) > 1 and steps[0] == top:
            _drop(result, steps[1:])
    return result


def _drop(node: Any, steps: list[str | int | None]) -> None:
    """Remove the value at ``steps`` below ``node`` (every element where a step is ``[*]``)."""
    step, rest = steps[0], steps[1:]
    if step is None and isinstance(node, list):
        if not rest:
            node.clear()
        for child in node:
            _drop(child, rest)
    elif isinstance(step, int) and isinstance(node, list) and step < len(node):
        if rest:
            _drop(node[step], rest)
        else:
            node[step] = None
    elif isinstance(step, str) and isinstance(node, dict) and step in node:
        if rest:
            _drop(node[step], rest)
        else:
            del node[step]


def key(resource_type: str, name: str) -> str:
    return f"{resource_type} {name}"


def _key(resource: RecordedResource) -> str:
    return key(resource.type, resource.name)
