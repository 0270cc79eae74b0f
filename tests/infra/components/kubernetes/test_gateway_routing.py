"""Gateway API routing (kubernetes.routing: gateway-api): one HTTPRoute, weighted backends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from infra.config import ConfigError

SCHEMA = Path(__file__).resolve().parent / "schemas" / "httproute-gateway-v1.json"
GATEWAY = {"routing": "gateway-api", "gateway": "gateways/public/https", "ingress_namespace": "envoy-gateway-system"}


@pytest.fixture(scope="module")
def objects(render: Any, variant_config: Any) -> list[dict[str, Any]]:
    manifests: list[dict[str, Any]] = render("k8s-prod", variant_config("k8s-prod", kubernetes=GATEWAY)).manifests
    return manifests


def _route(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [route] = [o for o in objects if o["kind"] == "HTTPRoute"]
    return route


def test_route_replaces_the_ingresses(objects: list[dict[str, Any]]) -> None:
    assert [o for o in objects if o["kind"] == "Ingress"] == []
    assert _route(objects)["apiVersion"] == "gateway.networking.k8s.io/v1"


def test_route_splits_traffic_by_the_canary_weight(objects: list[dict[str, Any]]) -> None:
    backends = _route(objects)["spec"]["rules"][0]["backendRefs"]
    assert [(b["name"], b["port"], b["weight"]) for b in backends] == [
        ("specdeploy-blue", 8000, 90), ("specdeploy-green", 8000, 10)]


def test_route_attaches_to_the_configured_gateway_listener(objects: list[dict[str, Any]]) -> None:
    assert _route(objects)["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                                      "namespace": "gateways", "name": "public",
                                                      "sectionName": "https"}]


def test_route_serves_the_stack_domain_with_a_timeout_above_the_server_one(objects: list[dict[str, Any]]) -> None:
    spec = _route(objects)["spec"]
    assert spec["hostnames"] == ["llm.example.com"]
    assert spec["rules"][0]["timeouts"] == {"request": "90s"}


def test_route_passes_the_schema_in_the_repo(objects: list[dict[str, Any]]) -> None:
    jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text())).validate(_route(objects))


def test_route_schema_rejects_a_weight_out_of_range(objects: list[dict[str, Any]]) -> None:
    route = _route(objects)
    route = {**route, "spec": {**route["spec"], "rules": [{"backendRefs": [{"name": "x", "weight": -1}]}]}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text())).validate(route)


def test_network_policy_admits_the_gateway_proxies(objects: list[dict[str, Any]]) -> None:
    [policy] = [o for o in objects if o["kind"] == "NetworkPolicy"]
    sources = [p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
               for rule in policy["spec"]["ingress"] for p in rule["from"]]
    assert sources == ["envoy-gateway-system", "monitoring"]


@pytest.mark.parametrize("version", ["1.30.0", "1.33.0"])
def test_built_in_objects_stay_strictly_valid(objects: list[dict[str, Any]], version: str) -> None:
    for manifest in objects:
        if manifest["apiVersion"].startswith(("monitoring.coreos.com/", "gateway.networking.k8s.io/")):
            continue  # custom resources: schemas in tests/infra/components/kubernetes/schemas
        kubernetes_validate.validate(manifest, version, strict=True)


def test_single_slot_route_has_one_backend(render: Any, variant_config: Any) -> None:
    config = variant_config("k8s-dev", kubernetes={"routing": "gateway-api", "gateway": "gateways/internal"},
                            access={"allowed_cidrs": ["0.0.0.0/0"]})
    route = _route(render("k8s-dev", config).manifests)
    assert [(b["name"], b["weight"]) for b in route["spec"]["rules"][0]["backendRefs"]] == [("specdeploy-blue", 100)]
    assert "sectionName" not in route["spec"]["parentRefs"][0]



def test_gateway_is_required(variant_config: Any) -> None:
    with pytest.raises((ConfigError, ValueError), match=r"kubernetes\.gateway"):
        variant_config("k8s-dev", kubernetes={"routing": "gateway-api"})
