"""Weighted blue/green routing: primary Ingress to the active slot, canary Ingress to the idle one."""

from __future__ import annotations

from typing import Any

import pulumi
import pytest

from infra.components.kubernetes.routing import CANARY_WEIGHT_ANNOTATION

NGINX = "nginx.ingress.kubernetes.io"


def _backend(spec: Any) -> str:
    return str(spec.rules[0].http.paths[0].backend.service.name)


@pulumi.runtime.test
def test_primary_ingress_sends_traffic_to_the_active_slot(prod: Any) -> pulumi.Output[None]:
    def check(spec: Any) -> None:
        assert _backend(spec) == "specdeploy-blue"
    return prod().stack.routing.primary.spec.apply(check)


@pulumi.runtime.test
def test_canary_ingress_sends_traffic_to_the_idle_slot(prod: Any) -> pulumi.Output[None]:
    canary = prod().stack.routing.canary
    assert canary is not None

    def check(spec: Any) -> None:
        assert _backend(spec) == "specdeploy-green"
    return canary.spec.apply(check)


@pulumi.runtime.test
def test_canary_weight_comes_from_the_stack(prod: Any) -> pulumi.Output[None]:
    canary = prod().stack.routing.canary
    assert canary is not None

    def check(metadata: Any) -> None:
        assert metadata.annotations[f"{NGINX}/canary"] == "true"
        assert metadata.annotations[CANARY_WEIGHT_ANNOTATION] == "10"
        assert metadata.annotations[f"{NGINX}/canary-weight-total"] == "100"
    return canary.metadata.apply(check)


@pulumi.runtime.test
def test_canary_matches_the_primary_host_and_path(prod: Any) -> pulumi.Output[None]:
    routing = prod().stack.routing
    assert routing.canary is not None

    def check(primary: Any) -> pulumi.Output[None]:
        def same(canary: Any) -> None:
            assert [(r.host, r.http.paths[0].path) for r in canary.rules] == \
                [(r.host, r.http.paths[0].path) for r in primary.rules] == [("llm.example.com", "/")]
        assert routing.canary is not None
        return routing.canary.spec.apply(same)
    return routing.primary.spec.apply(check)


@pulumi.runtime.test
def test_public_ingress_terminates_tls_with_the_configured_secret(prod: Any) -> pulumi.Output[None]:
    def check(spec: Any) -> None:
        assert [(t.secret_name, t.hosts) for t in spec.tls] == [("llm-example-com-tls", ["llm.example.com"])]
        assert spec.ingress_class_name == "nginx"
    return prod().stack.routing.primary.spec.apply(check)


@pulumi.runtime.test
def test_streaming_responses_are_not_buffered(prod: Any) -> pulumi.Output[None]:
    def check(metadata: Any) -> None:
        assert metadata.annotations[f"{NGINX}/proxy-buffering"] == "off"
        assert int(metadata.annotations[f"{NGINX}/proxy-read-timeout"]) > 60
    return prod().stack.routing.primary.metadata.apply(check)


@pulumi.runtime.test
def test_internal_ingress_admits_only_the_allowed_cidrs(dev: Any) -> pulumi.Output[None]:
    def check(metadata: Any) -> None:
        assert metadata.annotations[f"{NGINX}/whitelist-source-range"] == "10.0.0.0/8"
    return dev().stack.routing.primary.metadata.apply(check)


@pulumi.runtime.test
def test_open_ingress_has_no_source_range(prod: Any) -> pulumi.Output[None]:
    def check(metadata: Any) -> None:
        assert f"{NGINX}/whitelist-source-range" not in metadata.annotations
    return prod().stack.routing.primary.metadata.apply(check)


@pulumi.runtime.test
def test_single_slot_stack_has_no_canary_ingress(dev: Any) -> pulumi.Output[None]:
    assert dev().stack.routing.canary is None
    return pulumi.Output.from_input(None)


def test_switching_the_active_slot_moves_the_primary_backend(render: Any, variant_config: Any) -> None:
    built = render("k8s-prod", variant_config("k8s-prod", release={"active": "green", "canary_weight": 0}))
    assert built.one("Ingress", "specdeploy")["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"][
        "name"] == "specdeploy-green"
    canary = built.one("Ingress", "specdeploy-canary")
    assert canary["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"] == "specdeploy-blue"
    assert canary["metadata"]["annotations"][CANARY_WEIGHT_ANNOTATION] == "0"


def test_exports_name_the_endpoint_and_weights(render: Any) -> None:
    exports = render("k8s-prod").exports
    assert (exports["endpoint"], exports["routing"], exports["active_slot"], exports["canary_weight"]) == (
        "https://llm.example.com", "ingress-nginx", "blue", 10)


def test_public_stack_without_tls_is_refused(variant_config: Any) -> None:
    with pytest.raises(ValueError, match="tls_secret"):
        variant_config("k8s-prod", kubernetes={"tls_secret": None})
