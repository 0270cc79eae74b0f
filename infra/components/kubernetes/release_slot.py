"""One release slot (blue or green) on Kubernetes: server config, weight cache, Deployment, Service.

The pod pulls and verifies its model version in init containers
(``python -m serving.weights pull URI DIR``, with the server image itself) into a cache volume, then the server loads
it read-only. Probes follow the server's contract: ``/health`` = process alive,
``/ready`` = weights loaded, warm-up done, not draining. Termination gives the
server its whole drain grace period before SIGKILL.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from infra.components.kubernetes.common import (
    API_KEYS_SECRET_KEY,
    CONFIG_DIR,
    HTTP_PORT_NAME,
    PRE_STOP_DELAY_S,
    SECRETS_DIR,
    SERVER_CONFIG_FILE,
    cache_dir,
    metadata_name,
    server_selector,
    slot_labels,
    slot_object_name,
)
from infra.config import MODEL_CACHE_DIR, KubernetesSpec

# The image's non-root user (serving/Dockerfile); any non-zero uid works with the volumes below.
RUN_AS_USER = 10001
STARTUP_PERIOD_S = 10
# Time a rollout allows the init containers to pull a version into a cold cache, on top of the startup budget.
PULL_ALLOWANCE_S = 600


@dataclass(frozen=True)
class ReleaseSlotArgs:
    slot: str  # "blue" or "green"
    image: str
    model_version: str  # weights URI of the target model, pulled into cache_dir(model_version)
    draft_version: str | None  # weights URI of the draft model; None when the stack serves none
    server_config_yaml: str  # the server's config file; its model paths are the cache_dir of each version
    port: int  # service.port
    pod: KubernetesSpec  # resources, scheduling, weight cache volume, Secrets, baseline replicas
    startup_budget_s: int  # weight load + warm-up the startup probe allows
    termination_grace_s: int  # preStop delay + the server's drain grace + slack
    namespace: pulumi.Input[str]
    service_account_name: pulumi.Input[str]


def _pull(name: str, image: str, uri: str, directory: str, spec: KubernetesSpec,
          security_context: k8s.core.v1.SecurityContextArgsDict) -> k8s.core.v1.ContainerArgsDict:
    container: k8s.core.v1.ContainerArgsDict = {
        "name": name,
        "image": image,
        "command": ["python3", "-m", "serving.weights", "pull", uri, directory],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": {"cpu": spec.cpu, "memory": spec.memory},
                      "limits": {"cpu": spec.cpu, "memory": spec.memory}},
        "security_context": security_context,
        "volume_mounts": [
            {"name": "weights", "mount_path": MODEL_CACHE_DIR},
            {"name": "tmp", "mount_path": "/tmp"},
        ],
    }
    if spec.weights_secret:
        # S3 credentials (AWS_ACCESS_KEY_ID, ...) only for the pull; the server never sees them.
        container["env_from"] = [{"secret_ref": {"name": spec.weights_secret}}]
    return container


def _cache_volume(slot: str, spec: KubernetesSpec) -> k8s.core.v1.VolumeArgsDict:
    if spec.weight_cache == "pvc":
        return {"name": "weights", "persistent_volume_claim": {"claim_name": f"{slot_object_name(slot)}-weights"}}
    if spec.weight_cache == "hostPath":
        return {"name": "weights", "host_path": {"path": spec.host_path, "type": "DirectoryOrCreate"}}
    return {"name": "weights", "empty_dir": {"size_limit": spec.weight_cache_size}}


@dataclass(frozen=True)
class _Meta:
    """Naming shared by a slot's objects."""

    component: str  # Pulumi name of the ReleaseSlot; children are "<component>-<suffix>"
    object_name: str  # Kubernetes name of the slot's Deployment and Service
    namespace: pulumi.Input[str]
    labels: dict[str, str]

    def metadata(self, name: str) -> k8s.meta.v1.ObjectMetaArgsDict:
        return {"name": name, "namespace": self.namespace, "labels": self.labels}


def _config_map(meta: _Meta, server_yaml: str, opts: pulumi.ResourceOptions) -> k8s.core.v1.ConfigMap:
    config_sha = hashlib.sha256(server_yaml.encode()).hexdigest()
    # Immutable and named by content: a change is a new ConfigMap the Deployment rolls onto,
    # never an edit under running pods.
    return k8s.core.v1.ConfigMap(
        f"{meta.component}-config",
        metadata=meta.metadata(f"{meta.object_name}-config-{config_sha[:10]}"),
        data={SERVER_CONFIG_FILE: server_yaml},
        immutable=True,
        opts=opts,
    )


def _cache_claim(meta: _Meta, spec: KubernetesSpec, opts: pulumi.ResourceOptions) -> k8s.core.v1.PersistentVolumeClaim:
    claim: k8s.core.v1.PersistentVolumeClaimSpecArgsDict = {
        # Shared by every replica of the slot: the first pull fills it, the others find the
        # verified version and return at once. Needs a ReadWriteMany class (EFS, Filestore, NFS).
        "access_modes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": spec.weight_cache_size}},
    }
    if spec.storage_class:
        claim["storage_class_name"] = spec.storage_class
    return k8s.core.v1.PersistentVolumeClaim(
        f"{meta.component}-weights",
        metadata=meta.metadata(f"{meta.object_name}-weights"),
        spec=claim,
        opts=opts,
    )


def _container_security_context() -> k8s.core.v1.SecurityContextArgsDict:
    return {
        "allow_privilege_escalation": False,
        "read_only_root_filesystem": True,
        "run_as_non_root": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _server_container(image: str, port: int, spec: KubernetesSpec, startup_budget: int,
                      security_context: k8s.core.v1.SecurityContextArgsDict) -> k8s.core.v1.ContainerArgsDict:
    resources: dict[str, str] = {"cpu": spec.cpu, "memory": spec.memory}
    if spec.gpus_per_pod:
        resources["nvidia.com/gpu"] = str(spec.gpus_per_pod)
    return {
        "name": "server",
        "image": image,
        "command": ["python3", "-m", "serving", "--config", f"{CONFIG_DIR}/{SERVER_CONFIG_FILE}"],
        "ports": [{"name": HTTP_PORT_NAME, "container_port": port, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": resources, "limits": resources},
        "security_context": security_context,
        # The server answers /health while it loads; /ready turns 200 only after the weights are
        # loaded and the warm-up generation ran. Probing /ready here is what bounds load + warm-up:
        # a pod that is not ready within the budget is restarted. Liveness starts after it.
        "startup_probe": {
            "http_get": {"port": HTTP_PORT_NAME, "path": "/ready"},
            "period_seconds": STARTUP_PERIOD_S,
            "timeout_seconds": 5,
            "failure_threshold": math.ceil(startup_budget / STARTUP_PERIOD_S),
        },
        "readiness_probe": {
            "http_get": {"port": HTTP_PORT_NAME, "path": "/ready"},
            "period_seconds": 5,
            "timeout_seconds": 3,
            "failure_threshold": 2,
        },
        "liveness_probe": {
            "http_get": {"port": HTTP_PORT_NAME, "path": "/health"},
            "period_seconds": 10,
            "timeout_seconds": 5,
            "failure_threshold": 6,
        },
        # Keep serving while endpoints are withdrawn, then SIGTERM starts the server's own drain.
        "lifecycle": {"pre_stop": {"exec_": {"command": ["sleep", str(PRE_STOP_DELAY_S)]}}},
        "volume_mounts": [
            {"name": "config", "mount_path": CONFIG_DIR, "read_only": True},
            {"name": "api-keys", "mount_path": SECRETS_DIR, "read_only": True},
            {"name": "weights", "mount_path": MODEL_CACHE_DIR, "read_only": True},
            {"name": "tmp", "mount_path": "/tmp"},
            {"name": "dshm", "mount_path": "/dev/shm"},
        ],
    }


def _pod_spec(slot: str, spec: KubernetesSpec, service_account_name: pulumi.Input[str],
              config_map_name: pulumi.Input[str], init_containers: list[k8s.core.v1.ContainerArgsDict],
              server: k8s.core.v1.ContainerArgsDict, termination_grace_s: int) -> k8s.core.v1.PodSpecArgsDict:
    volumes: list[k8s.core.v1.VolumeArgsDict] = [
        {"name": "config", "config_map": {"name": config_map_name}},
        # Referenced, never rendered: the Secret exists in the namespace before `pulumi up`.
        {"name": "api-keys", "secret": {"secret_name": spec.api_key_secret,
                                        "items": [{"key": API_KEYS_SECRET_KEY, "path": API_KEYS_SECRET_KEY}]}},
        _cache_volume(slot, spec),
        {"name": "tmp", "empty_dir": {"size_limit": "1Gi"}},
        {"name": "dshm", "empty_dir": {"medium": "Memory", "size_limit": "2Gi"}},
    ]
    pod_spec: k8s.core.v1.PodSpecArgsDict = {
        "service_account_name": service_account_name,
        "automount_service_account_token": False,
        "security_context": {
            "run_as_non_root": True,
            "run_as_user": RUN_AS_USER,
            "run_as_group": RUN_AS_USER,
            "fs_group": RUN_AS_USER,
            "fs_group_change_policy": "OnRootMismatch",
            "seccomp_profile": {"type": "RuntimeDefault"},
        },
        "termination_grace_period_seconds": termination_grace_s,
        "enable_service_links": False,
        # Soft spread: one GPU node or zone going down should not take every replica of a slot.
        "topology_spread_constraints": [
            {"max_skew": 1, "topology_key": key, "when_unsatisfiable": "ScheduleAnyway",
             "label_selector": {"match_labels": server_selector(slot)}}
            for key in ("kubernetes.io/hostname", "topology.kubernetes.io/zone")
        ],
        "init_containers": init_containers,
        "containers": [server],
        "volumes": volumes,
    }
    if spec.node_selector:
        pod_spec["node_selector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [
            {"key": t.key, "operator": t.operator, "value": t.value, "effect": t.effect} for t in spec.tolerations
        ]
    return pod_spec


def _deployment(meta: _Meta, slot: str, replicas: int, pod_spec: k8s.core.v1.PodSpecArgsDict, rollout_budget: int,
                parent: pulumi.Resource) -> k8s.apps.v1.Deployment:
    return k8s.apps.v1.Deployment(
        f"{meta.component}-deployment",
        metadata=meta.metadata(meta.object_name),
        spec={
            "replicas": replicas,
            "selector": {"match_labels": server_selector(slot)},
            # A new pod must be ready before an old one goes: capacity never dips during a rollout.
            "strategy": {"type": "RollingUpdate", "rolling_update": {"max_surge": 1, "max_unavailable": 0}},
            "progress_deadline_seconds": rollout_budget,
            "template": {
                "metadata": {"labels": meta.labels},
                "spec": pod_spec,
            },
        },
        opts=pulumi.ResourceOptions(
            parent=parent,
            # The autoscaler owns the replica count after creation.
            ignore_changes=["spec.replicas"],
            # `pulumi up` waits for the rollout (pull + load + warm-up), not pulumi-kubernetes' 10 minutes.
            custom_timeouts=pulumi.CustomTimeouts(create=f"{rollout_budget}s", update=f"{rollout_budget}s"),
        ),
    )


def _service(meta: _Meta, slot: str, port: int, opts: pulumi.ResourceOptions) -> k8s.core.v1.Service:
    return k8s.core.v1.Service(
        f"{meta.component}-service",
        metadata=meta.metadata(meta.object_name),
        spec={
            "type": "ClusterIP",
            "selector": server_selector(slot),
            "ports": [{"name": HTTP_PORT_NAME, "port": port, "target_port": HTTP_PORT_NAME,
                       "protocol": "TCP"}],
        },
        opts=opts,
    )


class ReleaseSlot(pulumi.ComponentResource):
    """A slot's ConfigMap (server config), optional cache PVC, Deployment and ClusterIP Service."""

    config_map: k8s.core.v1.ConfigMap
    cache_claim: k8s.core.v1.PersistentVolumeClaim | None
    deployment: k8s.apps.v1.Deployment
    service: k8s.core.v1.Service
    deployment_name: pulumi.Output[str]
    service_name: pulumi.Output[str]

    def __init__(self, name: str, args: ReleaseSlotArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("specdeploy:kubernetes:ReleaseSlot", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        slot, spec = args.slot, args.pod
        meta = _Meta(name, slot_object_name(slot), args.namespace, slot_labels(slot))

        self.config_map = _config_map(meta, args.server_config_yaml, child)
        self.cache_claim = _cache_claim(meta, spec, child) if spec.weight_cache == "pvc" else None

        security_context = _container_security_context()
        init_containers = [_pull("pull-target", args.image, args.model_version, cache_dir(args.model_version), spec,
                                 security_context)]
        if args.draft_version:
            init_containers.append(_pull("pull-draft", args.image, args.draft_version, cache_dir(args.draft_version),
                                         spec, security_context))
        server = _server_container(args.image, args.port, spec, args.startup_budget_s, security_context)
        pod_spec = _pod_spec(slot, spec, args.service_account_name, metadata_name(self.config_map),
                             init_containers, server, args.termination_grace_s)
        self.deployment = _deployment(meta, slot, spec.min_replicas, pod_spec,
                                      args.startup_budget_s + PULL_ALLOWANCE_S, parent=self)
        self.deployment_name = metadata_name(self.deployment)
        self.service = _service(meta, slot, args.port, child)
        self.service_name = metadata_name(self.service)

        self.register_outputs({"deployment_name": self.deployment_name, "service_name": self.service_name})
