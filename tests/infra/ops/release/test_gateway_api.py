"""`kubernetes.routing: gateway-api`: rollout and rollback move the HTTPRoute's backendRefs weights.

The k8s-prod stack with Gateway API routing is rendered offline; the weight change is
checked on the rendered HTTPRoute (against the schema in the repo) and end to end through
the CLI against the loopback API server of test_kubernetes.py holding those objects.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from infra.config import load_stack, project_stacks_dir
from infra.ops.release.kubernetes import HTTPROUTES, route_patch, route_weights, the_route
from infra.ops.release.model import ReleaseError, weights_to

from .conftest import SlotServer, rbac_check
from .test_kubernetes import FAST, FakeApiServer, k8s, merge_patch, serve_objects

SCHEMA = Path(__file__).resolve().parents[2] / "components" / "kubernetes" / "schemas" / "httproute-gateway-v1.json"
ROUTE_PATH = HTTPROUTES.format("specdeploy") + "/specdeploy"


def gateway_variant(text: str) -> str:
    """Stack k8s-prod's file with its routing switched to an HTTPRoute on a shared Gateway."""
    marker = "    ingress_namespace: ingress-nginx\n"
    assert marker in text
    return text.replace(marker, "    routing: gateway-api\n    gateway: gateways/public/https\n"
                                "    ingress_namespace: envoy-gateway-system\n")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from infra.ops.k8s_render import render_objects
    from infra.program.preview import record_stack

    stacks = tmp_path_factory.mktemp("gateway-stacks")
    source = (project_stacks_dir() / "Pulumi.k8s-prod.yaml").read_text(encoding="utf-8")
    (stacks / "Pulumi.k8s-prod.yaml").write_text(gateway_variant(source), encoding="utf-8")
    result = record_stack("k8s-prod", stacks)
    return render_objects((r.type, r.inputs) for r in result.resources)


def route(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [found] = [o for o in objects if o["kind"] == "HTTPRoute"]
    return found


def backends(obj: dict[str, Any]) -> list[tuple[str, int]]:
    return [(b["name"], b["weight"]) for b in obj["spec"]["rules"][0]["backendRefs"]]


def test_rendered_route_weights_match_the_stack_file(rendered: list[dict[str, Any]]) -> None:
    assert route_weights(route(rendered)) == {"blue": 90, "green": 10}


@pytest.mark.parametrize(("slot", "percent"), [("green", 50), ("green", 100), ("blue", 100)])
def test_patched_route_routes_the_new_weights_and_stays_valid(rendered: list[dict[str, Any]], slot: str,
                                                              percent: int) -> None:
    original = route(rendered)
    patched = merge_patch(original, route_patch(original, weights_to(slot, percent)))
    assert route_weights(patched) == weights_to(slot, percent)
    jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text())).validate(patched)
    # Only the weights change: parents, hostnames, matches and timeouts stay as rendered.
    unchanged = copy.deepcopy(patched)
    for mine, theirs in zip(unchanged["spec"]["rules"][0]["backendRefs"], original["spec"]["rules"][0]["backendRefs"],
                            strict=True):
        mine["weight"] = theirs["weight"]
    assert unchanged == original


def test_a_route_without_both_slots_is_refused_by_name(rendered: list[dict[str, Any]]) -> None:
    one_slot = copy.deepcopy(route(rendered))
    one_slot["spec"]["rules"][0]["backendRefs"] = one_slot["spec"]["rules"][0]["backendRefs"][:1]
    with pytest.raises(ReleaseError, match="HTTPRoute specdeploy has no backendRef for slot.*green"):
        route_weights(one_slot)
    with pytest.raises(ReleaseError, match="expected one routing HTTPRoute .* found: none"):
        the_route([], "specdeploy")


@pytest.fixture
def api_server(rendered: list[dict[str, Any]]) -> Iterator[FakeApiServer]:
    with serve_objects(rendered) as fake:
        yield fake


@pytest.fixture
def gateway_copy(prod_copy: Path) -> Path:
    path = prod_copy / "Pulumi.k8s-prod.yaml"
    path.write_text(gateway_variant(path.read_text(encoding="utf-8")), encoding="utf-8")
    return prod_copy


def test_rollout_moves_the_route_weights_and_updates_the_stack_file(
        api_server: FakeApiServer, kubeconfig: Path, gateway_copy: Path, slot_server: SlotServer,
        capsys: pytest.CaptureFixture[str], rendered: list[dict[str, Any]]) -> None:
    assert k8s("rollout", gateway_copy, kubeconfig, "--to", "green", "--steps", "50,100",
               "--slot-endpoint", slot_server.url, "--prometheus-url", api_server.url, *FAST) == 0
    assert "via Gateway API HTTPRoute weights in namespace specdeploy" in capsys.readouterr().out
    assert api_server.patches() == [ROUTE_PATH, ROUTE_PATH]
    assert backends(api_server.objects[ROUTE_PATH]) == [("specdeploy-blue", 0), ("specdeploy-green", 100)]
    release = load_stack("k8s-prod", gateway_copy).config.slots
    assert (release.active, release.canary_weight) == ("green", 0)
    # every request was one the rendered Role grants (its lock and audit rules are exercised end to end in
    # test_kubernetes.py; here: the route's own rules, all used)
    role = next(o for o in rendered if o["kind"] == "Role" and o["metadata"]["name"] == "specdeploy-release")
    denied, unused = rbac_check(api_server.calls, role)
    assert denied == []
    assert [u for u in unused if "httproutes" in u] == []


def test_firing_alert_rolls_the_route_back(api_server: FakeApiServer, kubeconfig: Path, gateway_copy: Path,
                                           slot_server: SlotServer) -> None:
    api_server.firing, api_server.firing_after_patches = ["SpecdeployHighP99Ttft"], 1
    assert k8s("rollout", gateway_copy, kubeconfig, "--to", "green", "--slot-endpoint", slot_server.url,
               "--prometheus-url", api_server.url, *FAST) == 1
    assert backends(api_server.objects[ROUTE_PATH]) == [("specdeploy-blue", 100), ("specdeploy-green", 0)]


def test_rollback_is_one_patch_of_the_route(api_server: FakeApiServer, kubeconfig: Path, gateway_copy: Path) -> None:
    assert k8s("rollback", gateway_copy, kubeconfig, "--record") == 0
    assert api_server.patches() == [ROUTE_PATH]
    assert backends(api_server.objects[ROUTE_PATH]) == [("specdeploy-blue", 100), ("specdeploy-green", 0)]
    release = load_stack("k8s-prod", gateway_copy).config.slots
    assert (release.active, release.canary_weight) == ("blue", 0)


def test_a_route_changed_since_it_was_read_is_not_overwritten(api_server: FakeApiServer, kubeconfig: Path) -> None:
    from infra.ops.release.kubernetes import HttpRouteRouter, KubeApi

    stale = copy.deepcopy(api_server.objects[ROUTE_PATH])
    router = HttpRouteRouter(KubeApi.from_environment(kubeconfig), "specdeploy")
    router.set_weights(weights_to("green", 50))  # someone else's change: resourceVersion 1 -> 2
    api = router.api
    with pytest.raises(ReleaseError, match="HTTP 409"):
        api.merge_patch(ROUTE_PATH, route_patch(stale, weights_to("blue", 100)))
    assert route_weights(api_server.objects[ROUTE_PATH]) == {"blue": 50, "green": 50}
