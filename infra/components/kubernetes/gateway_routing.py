"""Weighted blue/green routing with Gateway API: one HTTPRoute with two weighted backends.

The route attaches to an existing Gateway (``kubernetes.gateway``: namespace/name[/listener])
that the platform team runs (Envoy Gateway, Istio, Cilium, NGINX Gateway Fabric, a cloud
gateway); TLS terminates at its listener. The active slot's Service gets
``100 - canary_weight``, the idle slot's ``canary_weight`` — a traffic shift is one weight
change, a rollback needs no pod to start. The portable successor of the ingress-nginx
canary (docs/kubernetes.md, "Routing").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra.components.kubernetes.common import app_labels
from infra.components.kubernetes.routing import TrafficSplit, proxy_timeout_s

GATEWAY_API = "gateway.networking.k8s.io/v1"


# Pulumi property path of what the release commands own (ignore_changes)
ROUTE_BACKENDS = "spec.rules[*].backendRefs"


@dataclass(frozen=True)
class GatewayRoutingArgs:
    namespace: pulumi.Input[str]
    split: TrafficSplit  # the Services of the active and idle slots and the canary weight
    gateway: str | None  # kubernetes.gateway: namespace/name[/listener]
    host: str | None  # access.domain; None matches every hostname
    port: int  # the Services' port (service.port)
    request_timeout_s: float  # the server's scheduler.request_timeout_s

    def __post_init__(self) -> None:
        if self.gateway is None:
            raise ValueError("kubernetes.gateway (namespace/name) is required when kubernetes.routing is gateway-api")


def parent_ref(gateway: str) -> dict[str, str]:
    """`namespace/name[/listener]` as an HTTPRoute parentRef."""
    namespace, name, *listener = gateway.split("/")
    ref = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": namespace, "name": name}
    if listener:
        ref["sectionName"] = listener[0]
    return ref


class GatewayRouting(pulumi.ComponentResource):
    """An HTTPRoute splitting the host between the slots' Services by weight."""

    route: k8s.apiextensions.CustomResource
    host: str | None
    canary_weight: int

    def __init__(self, name: str, args: GatewayRoutingArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("specdeploy:kubernetes:GatewayRouting", name, None, opts)
        split, port = args.split, args.port
        self.host = args.host
        self.canary_weight = split.canary_weight

        backends: list[dict[str, Any]] = [
            {"name": split.active_service, "port": port, "weight": 100 - split.canary_weight}]
        if split.idle_service is not None:
            backends.append({"name": split.idle_service, "port": port, "weight": split.canary_weight})
        route_spec: dict[str, Any] = {
            "parentRefs": [parent_ref(str(args.gateway))],
            "rules": [{
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": backends,
                # Above the server's own request timeout, which answers 504 itself.
                "timeouts": {"request": f"{proxy_timeout_s(args.request_timeout_s)}s"},
            }],
        }
        if self.host:
            route_spec["hostnames"] = [self.host]
        self.route = k8s.apiextensions.CustomResource(
            f"{name}-http-route",
            api_version=GATEWAY_API,
            kind="HTTPRoute",
            metadata={"name": "specdeploy", "namespace": args.namespace, "labels": app_labels("routing")},
            spec=route_spec,
            # the backends and their weights are the release tool's once created (route_patch): a later
            # `pulumi up` of a stale or recorded stack file leaves the live split alone
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=[ROUTE_BACKENDS]),
        )

        self.register_outputs({"host": self.host, "canary_weight": self.canary_weight})
