"""The namespace the service runs in, with Pod Security admission, and the pods' ServiceAccount."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from infra.components.kubernetes.common import APP, app_labels, metadata_name

SERVICE_ACCOUNT = f"{APP}-server"


@dataclass(frozen=True)
class ServingNamespaceArgs:
    namespace: str  # kubernetes.namespace
    host_path_cache: bool  # the weight cache is a hostPath volume, which Pod Security `restricted` forbids
    # Annotations of the ServiceAccount: workload identity (IRSA, GKE) for the weight pull instead of static keys.
    service_account_annotations: dict[str, str]


class ServingNamespace(pulumi.ComponentResource):
    """Namespace (Pod Security `restricted` enforced unless a hostPath cache needs `privileged`)
    and a ServiceAccount without an API token: the server never talks to the Kubernetes API."""

    namespace: k8s.core.v1.Namespace
    service_account: k8s.core.v1.ServiceAccount
    name: pulumi.Output[str]
    service_account_name: pulumi.Output[str]

    def __init__(self, name: str, args: ServingNamespaceArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("specdeploy:kubernetes:ServingNamespace", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)

        # hostPath volumes are forbidden by the baseline and restricted levels; such a stack still
        # gets the restricted level as a warning and audit so every other deviation shows up.
        pod_security = {
            "pod-security.kubernetes.io/warn": "restricted",
            "pod-security.kubernetes.io/audit": "restricted",
            "pod-security.kubernetes.io/enforce": "privileged" if args.host_path_cache else "restricted",
        }
        self.namespace = k8s.core.v1.Namespace(
            f"{name}-namespace",
            metadata={"name": args.namespace, "labels": {**app_labels("namespace"), **pod_security}},
            opts=child,
        )
        self.name = metadata_name(self.namespace)

        self.service_account = k8s.core.v1.ServiceAccount(
            f"{name}-service-account",
            metadata={"name": SERVICE_ACCOUNT, "namespace": self.name, "labels": app_labels("server"),
                      "annotations": dict(args.service_account_annotations)},
            automount_service_account_token=False,
            opts=child,
        )
        self.service_account_name = metadata_name(self.service_account)

        self.register_outputs({"name": self.name, "service_account_name": self.service_account_name})
