"""The `platform: kubernetes` program: wires the Kubernetes components from one StackConfig.

Called by ``infra/__main__.py``; returns the stack exports instead of exporting them,
so the caller decides and tests can read them. Objects go to the cluster of the
ambient kubeconfig (or the `kubernetes:` provider settings of the stack).
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi

from infra.components.kubernetes.autoscaling import QueueAutoscaler, QueueAutoscalerArgs
from infra.components.kubernetes.common import kubernetes_spec
from infra.components.kubernetes.gateway_routing import GatewayRouting, GatewayRoutingArgs
from infra.components.kubernetes.namespace import ServingNamespace, ServingNamespaceArgs
from infra.components.kubernetes.observability import ServingObservability, ServingObservabilityArgs
from infra.components.kubernetes.release_slot import ReleaseSlot, ReleaseSlotArgs
from infra.components.kubernetes.routing import WeightedRouting, WeightedRoutingArgs
from infra.components.kubernetes.security import ServingGuards, ServingGuardsArgs
from infra.config import SLOTS, StackConfig


@dataclass(frozen=True)
class KubernetesStack:
    """The components of one Kubernetes stack; tests read them, the program exports `exports()`."""

    config: StackConfig
    namespace: ServingNamespace
    slots: dict[str, ReleaseSlot]  # slot name -> its component, only slots the stack defines
    routing: WeightedRouting | GatewayRouting  # by kubernetes.routing
    autoscaler: QueueAutoscaler
    guards: ServingGuards
    observability: ServingObservability

    def exports(self) -> dict[str, pulumi.Output]:
        spec = kubernetes_spec(self.config)
        scheme = "https" if spec.tls_secret else "http"
        endpoint = f"{scheme}://{self.routing.host}" if self.routing.host else None
        return {
            "platform": pulumi.Output.from_input("kubernetes"),
            "namespace": self.namespace.name,
            "endpoint": pulumi.Output.from_input(endpoint),
            "routing": pulumi.Output.from_input(spec.routing),
            "active_slot": pulumi.Output.from_input(self.config.slots.active),
            "canary_weight": pulumi.Output.from_input(self.routing.canary_weight),
            "slot_services": pulumi.Output.all(**{slot: c.service_name for slot, c in self.slots.items()}),
            "slot_deployments": pulumi.Output.all(**{slot: c.deployment_name for slot, c in self.slots.items()}),
            "alert_names": pulumi.Output.from_input(self.observability.alert_names),
        }


def build_kubernetes(config: StackConfig) -> KubernetesStack:
    """Build every Kubernetes object of the stack."""
    spec = kubernetes_spec(config)
    release = config.slots

    namespace = ServingNamespace("specdeploy", ServingNamespaceArgs(spec=spec))
    slots: dict[str, ReleaseSlot] = {}
    for slot in SLOTS:
        slot_spec = release.slot(slot)
        if slot_spec is not None:
            slots[slot] = ReleaseSlot(f"specdeploy-{slot}", ReleaseSlotArgs(
                slot=slot,
                spec=slot_spec,
                config=config,
                namespace=namespace.name,
                service_account_name=namespace.service_account_name,
            ))

    slot_services: dict[str, pulumi.Input[str]] = {slot: c.service_name for slot, c in slots.items()}
    routing: WeightedRouting | GatewayRouting
    if spec.routing == "gateway-api":
        routing = GatewayRouting("specdeploy", GatewayRoutingArgs(config, namespace.name, slot_services))
    else:
        routing = WeightedRouting("specdeploy", WeightedRoutingArgs(config, namespace.name, slot_services))
    autoscaler = QueueAutoscaler("specdeploy", QueueAutoscalerArgs(
        spec=spec,
        namespace=namespace.name,
        deployments={slot: component.deployment_name for slot, component in slots.items()},
    ))
    guards = ServingGuards("specdeploy", ServingGuardsArgs(config=config, namespace=namespace.name,
                                                           slots=sorted(slots)))
    observability = ServingObservability("specdeploy", ServingObservabilityArgs(config=config,
                                                                                namespace=namespace.name))
    return KubernetesStack(config, namespace, slots, routing, autoscaler, guards, observability)


def deploy_kubernetes(config: StackConfig) -> dict[str, pulumi.Output]:
    """Build the Kubernetes stack; returns its exports for `infra/__main__.py` to export."""
    return build_kubernetes(config).exports()
