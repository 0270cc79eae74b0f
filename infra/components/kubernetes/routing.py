"""Weighted blue/green routing with ingress-nginx: a primary Ingress and a canary Ingress.

The primary Ingress sends traffic to the active slot's Service. When the idle slot
exists, a second Ingress for the same host and path carries ingress-nginx's canary
annotations and receives ``canary_weight`` percent of requests. Shifting traffic is
one annotation change (``specdeploy rollout`` / ``rollback`` patch it, the stack file
records it); a rollback needs no pod to start. Why ingress-nginx rather than a
Gateway API HTTPRoute: docs/kubernetes.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from infra.components.kubernetes.common import HTTP_PORT_NAME, SLOT_LABEL, app_labels
from infra.config import OPEN_CIDRS, ReleaseSpec

NGINX = "nginx.ingress.kubernetes.io"
CANARY_WEIGHT_ANNOTATION = f"{NGINX}/canary-weight"
# Pulumi property paths of the fields the release commands own (ignore_changes)
BACKENDS = "spec.rules[*].http.paths[*].backend"
CANARY_RELEASE_FIELDS = [
    BACKENDS,
    f'metadata.annotations["{CANARY_WEIGHT_ANNOTATION}"]',
    f'metadata.annotations["{NGINX}/canary-weight-total"]',
    f'metadata.labels["{SLOT_LABEL}"]',
]


@dataclass(frozen=True)
class TrafficSplit:
    """Which Service takes the traffic and how much goes to the idle slot's; both routing modes take it."""

    active_service: pulumi.Input[str]
    idle_service: pulumi.Input[str] | None  # None while the stack defines one slot
    canary_weight: int  # percent on the idle slot; 0 without one
    idle_slot: str | None = None  # the slot behind idle_service


def traffic_split(release: ReleaseSpec, slot_services: dict[str, pulumi.Input[str]]) -> TrafficSplit:
    """The release section applied to the slots that have a Service (slot name -> Service name)."""
    if release.active not in slot_services:
        raise ValueError(f"release.active is {release.active!r} but that slot has no Service")
    idle = release.idle_slot
    idle_service = slot_services.get(idle) if idle else None
    if release.canary_weight and idle_service is None:
        raise ValueError("release.canary_weight > 0 needs both slots defined")
    if idle_service is None:
        return TrafficSplit(slot_services[release.active], None, 0)
    return TrafficSplit(slot_services[release.active], idle_service, release.canary_weight, idle)


def proxy_timeout_s(request_timeout_s: float) -> int:
    """The proxy's request timeout: above the server's own, which answers 504 itself."""
    return int(request_timeout_s) + 30


@dataclass(frozen=True)
class WeightedRoutingArgs:
    namespace: pulumi.Input[str]
    split: TrafficSplit  # the Services of the active and idle slots and the canary weight
    host: str | None  # access.domain; None routes every host
    ingress_class: str
    tls_secret: str | None  # Secret with the certificate; None serves plain HTTP
    allowed_cidrs: list[str]  # source allow-list (access.allowed_cidrs); not rendered when open to the world
    request_timeout_s: float  # the server's scheduler.request_timeout_s


def _primary_annotations(args: WeightedRoutingArgs) -> dict[str, str]:
    timeout = str(proxy_timeout_s(args.request_timeout_s))
    annotations = {
        # Streamed completions (SSE) must reach the client token by token.
        f"{NGINX}/proxy-buffering": "off",
        f"{NGINX}/proxy-read-timeout": timeout,
        f"{NGINX}/proxy-send-timeout": timeout,
    }
    if not OPEN_CIDRS & set(args.allowed_cidrs):
        annotations[f"{NGINX}/whitelist-source-range"] = ",".join(args.allowed_cidrs)
    if args.tls_secret:
        annotations[f"{NGINX}/ssl-redirect"] = "true"
    return annotations


class WeightedRouting(pulumi.ComponentResource):
    """Primary Ingress to the active slot; canary Ingress to the idle slot when it is defined."""

    primary: k8s.networking.v1.Ingress
    canary: k8s.networking.v1.Ingress | None
    host: str | None
    canary_weight: int

    def __init__(self, name: str, args: WeightedRoutingArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("specdeploy:kubernetes:WeightedRouting", name, None, opts)
        split = args.split
        self.host = args.host
        self.canary_weight = split.canary_weight

        def ingress_spec(service: pulumi.Input[str]) -> k8s.networking.v1.IngressSpecArgsDict:
            rule: k8s.networking.v1.IngressRuleArgsDict = {"http": {"paths": [{
                "path": "/",
                "path_type": "Prefix",
                "backend": {"service": {"name": service, "port": {"name": HTTP_PORT_NAME}}},
            }]}}
            if self.host:
                rule["host"] = self.host
            result: k8s.networking.v1.IngressSpecArgsDict = {"ingress_class_name": args.ingress_class,
                                                              "rules": [rule]}
            if args.tls_secret:
                tls: k8s.networking.v1.IngressTLSArgsDict = {"secret_name": args.tls_secret}
                if self.host:
                    tls["hosts"] = [self.host]
                result["tls"] = [tls]
            return result

        # Which Service each Ingress sends to, the canary's slot label and its weight are the release tool's
        # once created (`specdeploy rollout|rollback` patch the live objects): a later `pulumi up` — of a stale
        # or a recorded stack file, refreshed or not — must not move traffic. A recorded promotion renders the
        # same split the other way round (primary -> new slot, canary weight 0) while the live objects keep
        # primary -> old slot, canary -> new slot at 100; applying it would route through the old slot.
        self.primary = k8s.networking.v1.Ingress(
            f"{name}-ingress",
            metadata={
                "name": "specdeploy",
                "namespace": args.namespace,
                "labels": app_labels("routing"),
                "annotations": _primary_annotations(args),
            },
            spec=ingress_spec(split.active_service),
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=[BACKENDS]),
        )

        self.canary = None
        if split.idle_service is not None:
            self.canary = k8s.networking.v1.Ingress(
                f"{name}-canary-ingress",
                metadata={
                    "name": "specdeploy-canary",
                    "namespace": args.namespace,
                    "labels": {**app_labels("routing"), SLOT_LABEL: str(split.idle_slot)},
                    "annotations": {
                        f"{NGINX}/canary": "true",
                        CANARY_WEIGHT_ANNOTATION: str(self.canary_weight),
                        f"{NGINX}/canary-weight-total": "100",
                    },
                },
                spec=ingress_spec(split.idle_service),
                opts=pulumi.ResourceOptions(parent=self, ignore_changes=CANARY_RELEASE_FIELDS),
            )

        self.register_outputs({"host": self.host, "canary_weight": self.canary_weight})
