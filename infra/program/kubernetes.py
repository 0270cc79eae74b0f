"""The `platform: kubernetes` program: wires the Kubernetes components from one StackConfig.

Called by :func:`infra.program.deploy`; returns the stack exports instead of exporting
them, so the caller decides and tests can read them. Each component takes narrow Args;
the small functions at the end shape them from the stack config. Objects go to the
cluster of the ambient kubeconfig (or the `kubernetes:` provider settings of the stack).
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi

from infra.alerts import alert_rules
from infra.components.kubernetes.autoscaling import QueueAutoscaler, QueueAutoscalerArgs
from infra.components.kubernetes.common import (
    API_KEYS_SECRET_KEY,
    SECRETS_DIR,
    cache_dir,
    kubernetes_spec,
    startup_budget_s,
    termination_grace_s,
)
from infra.components.kubernetes.gateway_routing import GatewayRouting, GatewayRoutingArgs
from infra.components.kubernetes.namespace import ServingNamespace, ServingNamespaceArgs
from infra.components.kubernetes.observability import ServingObservability, ServingObservabilityArgs
from infra.components.kubernetes.release_access import ReleaseOperatorRole, ReleaseOperatorRoleArgs
from infra.components.kubernetes.release_slot import ReleaseSlot, ReleaseSlotArgs
from infra.components.kubernetes.routing import TrafficSplit, WeightedRouting, WeightedRoutingArgs, traffic_split
from infra.components.kubernetes.security import ServingGuards, ServingGuardsArgs
from infra.config import SLOTS, StackConfig, render_server_config


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
    release_access: ReleaseOperatorRole

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
            "release_role": self.release_access.role_name,  # bound to the group specdeploy-release
        }


def build_kubernetes(config: StackConfig) -> KubernetesStack:
    """Build every Kubernetes object of the stack."""
    spec = kubernetes_spec(config)
    namespace = ServingNamespace("specdeploy", ServingNamespaceArgs(
        namespace=spec.namespace, host_path_cache=spec.weight_cache == "hostPath",
        service_account_annotations=dict(spec.service_account_annotations),
    ))
    slots = {slot: ReleaseSlot(f"specdeploy-{slot}", slot_args(config, slot, namespace))
             for slot in defined_slots(config)}
    split = traffic_split(config.slots, {slot: component.service_name for slot, component in slots.items()})
    routing = build_routing(config, namespace.name, split)
    autoscaler = QueueAutoscaler("specdeploy", QueueAutoscalerArgs(
        namespace=namespace.name, deployments={slot: component.deployment_name for slot, component in slots.items()},
        min_replicas=spec.min_replicas, max_replicas=spec.max_replicas,
        queue_target_per_pod=spec.queue_target_per_pod, scale_down_stabilization_s=spec.scale_down_stabilization_s,
    ))
    guards = ServingGuards("specdeploy", ServingGuardsArgs(
        namespace=namespace.name, slots=sorted(slots), port=config.service.port,
        ingress_namespace=spec.ingress_namespace, prometheus_namespace=spec.prometheus_namespace,
        gate_cidrs=list(config.slots.gate_cidrs or []),
    ))
    observability = ServingObservability("specdeploy", ServingObservabilityArgs(
        namespace=namespace.name, server_namespace=spec.namespace, rules=alert_rules(config),
        runbook_base_url=config.alerting.runbook_base_url, prometheus_release=spec.prometheus_release,
        metrics_key_secret=spec.api_key_secret if config.service.metrics_require_auth else None,
        traffic_weights=config.slots.weights(),
    ))
    release_access = ReleaseOperatorRole("specdeploy-release", ReleaseOperatorRoleArgs(
        namespace=namespace.name, routing=spec.routing))
    return KubernetesStack(config, namespace, slots, routing, autoscaler, guards, observability, release_access)


def deploy_kubernetes(config: StackConfig) -> dict[str, pulumi.Output]:
    """Build the Kubernetes stack; returns its exports for :func:`infra.program.deploy` to export."""
    return build_kubernetes(config).exports()


def defined_slots(config: StackConfig) -> list[str]:
    """The release slots the stack defines, in SLOTS order."""
    return [slot for slot in SLOTS if config.slots.slot(slot) is not None]


def slot_args(config: StackConfig, slot: str, namespace: ServingNamespace) -> ReleaseSlotArgs:
    """A slot's image, weight versions and server config; the config's model paths are the cache
    directories the slot's init containers pull into."""
    spec = config.slots.slot(slot)
    if spec is None:
        raise ValueError(f"release.{slot} is not defined")
    serving = config.for_slot(slot)  # release.<slot>.server over the stack's scheduler / speculative
    draft_version = spec.draft_version if serving.uses_draft_model else None
    server_yaml = render_server_config(
        serving,
        model_path=cache_dir(spec.model_version),
        draft_path=cache_dir(draft_version) if draft_version else None,
        api_keys_file=f"{SECRETS_DIR}/{API_KEYS_SECRET_KEY}",
    ).to_yaml()
    return ReleaseSlotArgs(
        slot=slot, image=spec.image, model_version=spec.model_version, draft_version=draft_version,
        server_config_yaml=server_yaml, port=config.service.port, pod=kubernetes_spec(config),
        startup_budget_s=startup_budget_s(config), termination_grace_s=termination_grace_s(config),
        namespace=namespace.name, service_account_name=namespace.service_account_name,
    )


def build_routing(config: StackConfig, namespace: pulumi.Input[str],
                  split: TrafficSplit) -> WeightedRouting | GatewayRouting:
    """An HTTPRoute (kubernetes.routing gateway-api) or ingress-nginx's primary and canary Ingresses."""
    spec = kubernetes_spec(config)
    if spec.routing == "gateway-api":
        return GatewayRouting("specdeploy", GatewayRoutingArgs(
            namespace=namespace, split=split, gateway=spec.gateway, host=config.access.domain,
            port=config.service.port, request_timeout_s=config.scheduler.request_timeout_s,
        ))
    return WeightedRouting("specdeploy", WeightedRoutingArgs(
        namespace=namespace, split=split, host=config.access.domain, ingress_class=spec.ingress_class,
        tls_secret=spec.tls_secret, allowed_cidrs=list(config.access.allowed_cidrs),
        request_timeout_s=config.scheduler.request_timeout_s,
    ))
