"""Who may reach the server pods, and how many may be evicted at once.

The NetworkPolicy admits traffic to the server port only from the ingress
controller's namespace, from Prometheus' namespace and, when ``release.gate_cidrs``
is set, from those networks (the release tooling reaches each slot's pods directly, its slot path: the
API server's pod proxy is not admitted); everything else in the cluster is refused.
Egress stays open: the weight pull needs the object store, whose address (S3,
MinIO, a VPC endpoint) a policy cannot know in advance.
A PodDisruptionBudget per slot lets node drains take one pod at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_kubernetes as k8s

from infra.components.kubernetes.common import (
    app_labels,
    metadata_name,
    server_selector,
    slot_labels,
    slot_object_name,
)


@dataclass(frozen=True)
class ServingGuardsArgs:
    namespace: pulumi.Input[str]
    slots: list[str]  # the slots that have a Deployment
    port: int  # the server port (service.port), the only one admitted
    ingress_namespace: str  # where the ingress controller or gateway proxy pods run
    prometheus_namespace: str  # where Prometheus scrapes from
    gate_cidrs: list[str] = field(default_factory=list)  # release.gate_cidrs: where rollout gates run from


def _from_namespace(namespace: str) -> k8s.networking.v1.NetworkPolicyPeerArgsDict:
    # `kubernetes.io/metadata.name` is set by the API server on every namespace (1.22+): it cannot be spoofed
    # by someone labelling their own namespace.
    return {"namespace_selector": {"match_labels": {"kubernetes.io/metadata.name": namespace}}}


class ServingGuards(pulumi.ComponentResource):
    """NetworkPolicy for all server pods and a PodDisruptionBudget per slot."""

    network_policy: k8s.networking.v1.NetworkPolicy
    disruption_budgets: dict[str, k8s.policy.v1.PodDisruptionBudget]

    def __init__(self, name: str, args: ServingGuardsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("specdeploy:kubernetes:ServingGuards", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        port: list[k8s.networking.v1.NetworkPolicyPortArgsDict] = [{"protocol": "TCP", "port": args.port}]
        ingress: list[k8s.networking.v1.NetworkPolicyIngressRuleArgsDict] = [
            {"from_": [_from_namespace(args.ingress_namespace)], "ports": port},
            {"from_": [_from_namespace(args.prometheus_namespace)], "ports": port},
        ]
        if args.gate_cidrs:  # the release gates, reaching each slot's pods by address
            ingress.append({"from_": [{"ip_block": {"cidr": cidr}} for cidr in args.gate_cidrs], "ports": port})

        self.network_policy = k8s.networking.v1.NetworkPolicy(
            f"{name}-network-policy",
            metadata={"name": "specdeploy-server", "namespace": args.namespace, "labels": app_labels("security")},
            spec={
                "pod_selector": {"match_labels": server_selector()},
                "policy_types": ["Ingress"],
                "ingress": ingress,
            },
            opts=child,
        )

        self.disruption_budgets = {}
        for slot in sorted(args.slots):
            self.disruption_budgets[slot] = k8s.policy.v1.PodDisruptionBudget(
                f"{name}-{slot}-pdb",
                metadata={"name": slot_object_name(slot), "namespace": args.namespace, "labels": slot_labels(slot)},
                spec={
                    "max_unavailable": 1,
                    "selector": {"match_labels": server_selector(slot)},
                    # A pod that never became ready must not block a node drain.
                    "unhealthy_pod_eviction_policy": "AlwaysAllow",
                },
                opts=child,
            )

        self.register_outputs({"network_policy": metadata_name(self.network_policy)})
