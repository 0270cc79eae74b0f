"""ReleaseOperatorRole: what `specdeploy rollout|rollback|release record|unlock` may do in the stack's namespace.

A Role and a RoleBinding to the group `specdeploy-release` (map the pipeline's and the on-call operators'
identities to it: an EKS access entry's `kubernetesGroups`, or your OIDC group claim). Everything is scoped to
the namespace; nothing cluster-wide is granted. The rules are exactly the calls the release commands make:

- read and patch the routing: the ingress-nginx Ingresses or the HTTPRoute (list, patch);
- read the slots' Deployments (readiness) and list their pods (each slot's direct path), and read the pods' /metrics
  through the API server's proxy (the shift guard's metrics without a port-forward);
- the PrometheusRule `specdeploy-traffic` (patch, that object only): the live split the alerts follow;
- the release lock (a Lease: get, create, update to renew or take over an expired one, delete) and the
  audit ConfigMap (get, create, update).

`tests/infra/ops/release/test_kubernetes.py` replays every request a rollout, a rollback and an unlock send
to the stand-in API server against these rules, and checks that every rule is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from infra.components.kubernetes.common import APP, app_labels

RELEASE_GROUP = f"{APP}-release"  # the RBAC group the RoleBinding names
ROLE_NAME = f"{APP}-release"


def release_role_rules(routing: str) -> list[k8s.rbac.v1.PolicyRuleArgsDict]:
    """RBAC rules of the release commands; `routing` is kubernetes.routing."""
    routes: k8s.rbac.v1.PolicyRuleArgsDict
    if routing == "gateway-api":
        routes = {"api_groups": ["gateway.networking.k8s.io"], "resources": ["httproutes"], "verbs": ["list", "patch"]}
    else:
        routes = {"api_groups": ["networking.k8s.io"], "resources": ["ingresses"], "verbs": ["list", "patch"]}
    return [
        routes,
        {"api_groups": ["apps"], "resources": ["deployments"], "verbs": ["get"]},
        {"api_groups": [""], "resources": ["pods"], "verbs": ["list"]},
        {"api_groups": [""], "resources": ["pods/proxy"], "verbs": ["get"]},
        {"api_groups": ["coordination.k8s.io"], "resources": ["leases"],
         "verbs": ["get", "create", "update", "delete"]},
        {"api_groups": [""], "resources": ["configmaps"], "verbs": ["get", "create", "update"]},
        {"api_groups": ["monitoring.coreos.com"], "resources": ["prometheusrules"], "verbs": ["patch"],
         "resource_names": ["specdeploy-traffic"]},
    ]


@dataclass(frozen=True)
class ReleaseOperatorRoleArgs:
    namespace: pulumi.Input[str]
    routing: str  # kubernetes.routing


class ReleaseOperatorRole(pulumi.ComponentResource):
    role_name: pulumi.Output[str]

    def __init__(self, name: str, args: ReleaseOperatorRoleArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("specdeploy:kubernetes:ReleaseOperatorRole", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        labels = app_labels("release")
        role = k8s.rbac.v1.Role(
            f"{name}-role",
            metadata={"name": ROLE_NAME, "namespace": args.namespace, "labels": labels},
            rules=release_role_rules(args.routing),
            opts=child,
        )
        k8s.rbac.v1.RoleBinding(
            f"{name}-role-binding",
            metadata={"name": ROLE_NAME, "namespace": args.namespace, "labels": labels},
            role_ref={"api_group": "rbac.authorization.k8s.io", "kind": "Role", "name": ROLE_NAME},
            subjects=[{"api_group": "rbac.authorization.k8s.io", "kind": "Group", "name": RELEASE_GROUP}],
            opts=pulumi.ResourceOptions(parent=self, depends_on=[role]),
        )
        self.role_name = pulumi.Output.from_input(ROLE_NAME)
        self.register_outputs({"role_name": self.role_name})
