"""The Kubernetes section: pods, routing, the autoscaler, the weight cache."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from serving.config import StrictModel


class Toleration(StrictModel):
    key: str
    operator: Literal["Exists", "Equal"] = "Exists"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = "NoSchedule"


class KubernetesSpec(StrictModel):
    namespace: str = Field("specdeploy", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description="Namespace.")
    gpus_per_pod: int = Field(1, ge=0, le=16, description="nvidia.com/gpu per pod (0 for CPU clusters).")
    cpu: str = Field("8", description="CPU request and limit per pod.")
    memory: str = Field("64Gi", description="Memory request and limit per pod.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels for GPU nodes.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Taints the pods tolerate.")
    weight_cache: Literal["emptyDir", "pvc", "hostPath"] = Field("emptyDir", description="Weight cache volume.")
    weight_cache_size: str = Field("100Gi", description="Size of the cache volume.")
    storage_class: str | None = Field(None, description="StorageClass of the cache PVC.")
    host_path: str = Field("/var/cache/specdeploy/models", description="Node directory for hostPath cache.")
    routing: Literal["ingress-nginx", "gateway-api"] = Field(
        "ingress-nginx", description="Weighted blue/green: ingress-nginx canary Ingresses or a Gateway API HTTPRoute."
    )
    gateway: str | None = Field(
        None, pattern=r"^[a-z0-9-]+/[a-z0-9.-]+(/[a-z0-9-]+)?$",
        description="Gateway the HTTPRoute attaches to: namespace/name[/listener] (routing gateway-api).",
    )
    ingress_class: str = Field("nginx", description="IngressClass of the ingress controller.")
    tls_secret: str | None = Field(None, description="Secret with the TLS certificate (required if public).")
    api_key_secret: str = Field("specdeploy-api-keys", description="Existing Secret holding the API keys.")
    weights_secret: str | None = Field(None, description="Secret with S3 credentials for the weight pull.")
    service_account_annotations: dict[str, str] = Field(
        default_factory=dict,
        description="Annotations of the pods' ServiceAccount, e.g. eks.amazonaws.com/role-arn (workload identity).",
    )
    prometheus_namespace: str = Field("monitoring", description="Namespace Prometheus scrapes from.")
    prometheus_release: str = Field("kube-prometheus-stack", description="`release` label rules select.")
    ingress_namespace: str = Field(
        "ingress-nginx", description="Namespace of the ingress controller or gateway proxy pods (NetworkPolicy)."
    )
    # minReplicas 0 needs the HPAScaleToZero feature gate, off on every managed cluster.
    min_replicas: int = Field(1, ge=1, description="Baseline replicas per active slot (at least 1).")
    max_replicas: int = Field(4, ge=1, description="Upper bound of the autoscaler.")
    queue_target_per_pod: float = Field(
        8.0, gt=0, description="Autoscaler target: average waiting requests per pod (specdeploy_requests_waiting)."
    )
    scale_down_stabilization_s: int = Field(
        600, ge=0, le=3600, description="Autoscaler scale-down stabilisation window; GPU pods are slow to replace."
    )
    startup_budget_s: int | None = Field(
        None, ge=60, description="Startup probe budget for weight load and warm-up; default: from model size."
    )

    @model_validator(mode="after")
    def _gateway(self) -> KubernetesSpec:
        if self.routing == "gateway-api" and self.gateway is None:
            raise ValueError("kubernetes.gateway (namespace/name) is required when kubernetes.routing is gateway-api")
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"kubernetes.min_replicas ({self.min_replicas}) exceeds kubernetes.max_replicas ({self.max_replicas})"
            )
        return self
