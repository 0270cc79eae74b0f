"""Issue 13 on Kubernetes: the split `specdeploy rollout|rollback` sets on the live routing objects — the
ingress-nginx canary Ingress, or the Gateway API HTTPRoute — survives a later `pulumi up`, of the stale
stack file or of the recorded one, with and without --refresh.

Pulumi's update is simulated from two recordings of the program (tests/infra/pulumi_up.py): a resource is
updated when an input outside its ignore_changes paths differs from the state, and the update sends the
program's inputs with every ignored path set to the state's value — the last `up`'s inputs, or the live
object after --refresh. The objects here start as that `up` rendered them; the traffic shift is made with
the release tool's own merge patches.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from infra.components.kubernetes.common import slot_object_name
from infra.config import SLOTS
from infra.ops.release.kubernetes import canary_patch, route_patch
from infra.program.preview import PreviewResult, RecordedResource, record_stack
from tests.infra.conftest import write_variant
from tests.infra.pulumi_up import parse_path, planned_updates

INGRESS = "kubernetes:networking.k8s.io/v1:Ingress"
ROUTE = "kubernetes:gateway.networking.k8s.io/v1:HTTPRoute"
GREEN = {"blue": 0, "green": 100}
SERVICE_SLOT = {slot_object_name(slot): str(slot) for slot in SLOTS}
PROD_RELEASE = {"active": "blue", "canary_weight": 10}
RECORDED = {"active": "green", "canary_weight": 0}
GATEWAY = {"routing": "gateway-api", "gateway": "gateways/public/https", "ingress_namespace": "envoy-gateway-system"}


def stack(directory: Path, **sections: Any) -> PreviewResult:
    """Record the program for a copy of k8s-prod with `sections` replaced or merged."""
    directory.mkdir(parents=True)
    return record_stack("k8s-prod", write_variant(directory, "k8s-prod", **sections))


def merge(target: dict[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """RFC 7386 JSON merge patch, as the API server applies the release tool's patches."""
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, Mapping) and isinstance(target.get(k), dict):
            merge(target[k], v)
        else:
            target[k] = copy.deepcopy(v)
    return target


def routing(result: PreviewResult) -> dict[str, RecordedResource]:
    found = {r.name: r for r in result.resources if r.type in (INGRESS, ROUTE)}
    assert found, "no routing objects rendered"
    return found


def live_split(objects: Mapping[str, dict[str, Any]]) -> dict[str, int]:
    """Percent of requests per slot that the live objects route."""
    route = [o for o in objects.values() if o.get("kind") == "HTTPRoute"]
    if route:
        weights = {SERVICE_SLOT[b["name"]]: int(b["weight"]) for b in route[0]["spec"]["rules"][0]["backendRefs"]}
        total = sum(weights.values())
        return {slot: round(100 * weights.get(slot, 0) / total) for slot in SLOTS}
    split = dict.fromkeys(SLOTS, 0)
    canary_share = 0
    for obj in objects.values():
        annotations = obj["metadata"].get("annotations") or {}
        if annotations.get("nginx.ingress.kubernetes.io/canary") == "true":
            canary_share = int(annotations["nginx.ingress.kubernetes.io/canary-weight"])
            split[_backend_slot(obj)] += canary_share
    for obj in objects.values():
        if (obj["metadata"].get("annotations") or {}).get("nginx.ingress.kubernetes.io/canary") != "true":
            split[_backend_slot(obj)] += 100 - canary_share
    return split


def _backend_slot(ingress: Mapping[str, Any]) -> str:
    return SERVICE_SLOT[ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"]]


def shift_to_green(objects: dict[str, dict[str, Any]]) -> None:
    """What `specdeploy rollout --to green` leaves on the cluster: the tool's patches, applied."""
    for obj in objects.values():
        if obj.get("kind") == "HTTPRoute":
            merge(obj, route_patch(obj, GREEN))
        elif (obj["metadata"].get("annotations") or {}).get("nginx.ingress.kubernetes.io/canary") == "true":
            merge(obj, canary_patch(obj, GREEN))
    assert live_split(objects) == GREEN


def _copy_path(source: Any, target: Any, steps: list[str | int | None]) -> None:
    step, rest = steps[0], steps[1:]
    if step is None:
        if isinstance(source, list) and isinstance(target, list):
            for s, t in zip(source, target, strict=False):
                _copy_path(s, t, rest)
        return
    if isinstance(step, str) and isinstance(source, dict) and isinstance(target, dict) and step in source:
        if rest and step in target:
            _copy_path(source[step], target[step], rest)
        elif not rest:
            target[step] = copy.deepcopy(source[step])


def pulumi_up(state: PreviewResult, program: PreviewResult, live: dict[str, dict[str, Any]],
              refresh: bool) -> set[str]:
    """Apply an update of the routing objects to `live`; returns the names it updated."""
    old = routing(state)
    refreshed = {f"{r.type} {r.name}": {k: copy.deepcopy(live[r.name][k]) for k in r.inputs}
                 for r in old.values()} if refresh else None
    updates = planned_updates(state, program, refreshed)
    touched = set()
    for name, resource in routing(program).items():
        if f"{resource.type} {name}" not in updates:
            continue
        base = live[name] if refresh else old[name].inputs
        sent = copy.deepcopy(dict(resource.inputs))
        for path in resource.ignore_changes:  # the ignored fields keep the state's values
            steps = parse_path(path)
            _copy_path(base.get(steps[0]), sent.get(steps[0]), steps[1:])
        live[name] = sent
        touched.add(name)
    return touched


@pytest.mark.parametrize("kubernetes", [None, GATEWAY], ids=["ingress-nginx", "gateway-api"])
def test_the_live_split_survives_pulumi_up_of_a_stale_or_recorded_stack_file(
        tmp_path: Path, kubernetes: dict[str, str] | None) -> None:
    extra = {"kubernetes": kubernetes} if kubernetes else {}
    deployed = stack(tmp_path / "a", release=PROD_RELEASE, **extra)
    live = {name: copy.deepcopy(dict(r.inputs)) for name, r in routing(deployed).items()}
    assert live_split(live) == {"blue": 90, "green": 10}
    shift_to_green(live)

    stale = deployed
    recorded = stack(tmp_path / "b", release=RECORDED, **extra)
    assert live_split({n: dict(r.inputs) for n, r in routing(recorded).items()}) == GREEN  # what it renders
    # an unrelated change to every routing object: the public host name
    changed = stack(tmp_path / "c", release=RECORDED, access={"domain": "llm2.example.com"}, **extra)
    for program in (stale, recorded):
        for refresh in (False, True):
            after = copy.deepcopy(live)
            assert pulumi_up(deployed, program, after, refresh) == set()  # no update reaches the routing
            assert live_split(after) == GREEN
    after = copy.deepcopy(live)
    assert pulumi_up(deployed, changed, after, refresh=True) == set(live)  # the new host is applied...
    assert live_split(after) == GREEN  # ...and the split the release tool set is kept


def test_without_refresh_an_unrelated_change_would_send_the_last_ups_split(tmp_path: Path) -> None:
    """Why the deploy pipeline runs `pulumi up` with refresh: the ignored fields keep the *state's* values,
    and without a refresh the state is the last `up`'s split, not the release tool's."""
    deployed = stack(tmp_path / "a", release=PROD_RELEASE)
    live = {name: copy.deepcopy(dict(r.inputs)) for name, r in routing(deployed).items()}
    shift_to_green(live)
    changed = stack(tmp_path / "c", release=RECORDED, access={"domain": "llm2.example.com"})
    assert pulumi_up(deployed, changed, live, refresh=False) == set(live)
    assert live_split(live) == {"blue": 90, "green": 10}
