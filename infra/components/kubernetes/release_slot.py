"""One release slot (blue or green) on Kubernetes: server config, weight cache, Deployment, Service.

The pod pulls and verifies its model version in init containers
(``specdeploy weights pull URI DIR``) into a cache volume, then the server loads
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
    kubernetes_spec,
    metadata_name,
    server_selector,
    slot_labels,
    slot_object_name,
    startup_budget_s,
    termination_grace_s,
)
from infra.config import MODEL_CACHE_DIR, KubernetesSpec, SlotSpec, StackConfig, render_server_config

# The image's non-root user (serving/Dockerfile); any non-zero uid works with the volumes below.
RUN_AS_USER = 10001
STARTUP_PERIOD_S = 10
# Time a rollout allows the init containers to pull a version into a cold cache, on top of the startup budget.
PULL_ALLOWANCE_S = 600


@dataclass(frozen=True)
class ReleaseSlotArgs:
    slot: str  # "blue" or "green"
    spec: SlotSpec  # image and model version(s) of this slot
    config: StackConfig  # the whole stack (server config, service, kubernetes sections)
    namespace: pulumi.Input[str]
    service_account_name: pulumi.Input[str]


def _uses_draft(config: StackConfig) -> bool:
    spec = config.speculative
    return spec.enabled and spec.method == "draft" and config.draft is not None


def _pull(name: str, image: str, uri: str, directory: str, spec: KubernetesSpec,
          security_context: k8s.core.v1.SecurityContextArgsDict) -> k8s.core.v1.ContainerArgsDict:
    container: k8s.core.v1.ContainerArgsDict = {
        "name": name,
        "image": image,
        "command": ["specdeploy", "weights", "pull", uri, directory],
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
        config, slot = args.config, args.slot
        spec = kubernetes_spec(config)
        use_draft = _uses_draft(config)
        if use_draft and args.spec.draft_version is None:
            raise ValueError(f"release.{slot}.draft_version is required: speculative.method is 'draft'")

        object_name = slot_object_name(slot)
        labels = slot_labels(slot)
        target_dir = cache_dir(args.spec.model_version)
        draft_dir = cache_dir(args.spec.draft_version) if use_draft and args.spec.draft_version else None

        server_yaml = render_server_config(
            config,
            model_path=target_dir,
            draft_path=draft_dir,
            api_keys_file=f"{SECRETS_DIR}/{API_KEYS_SECRET_KEY}",
        ).to_yaml()
        config_sha = hashlib.sha256(server_yaml.encode()).hexdigest()
        # Immutable and named by content: a change is a new ConfigMap the Deployment rolls onto,
        # never an edit under running pods.
        self.config_map = k8s.core.v1.ConfigMap(
            f"{name}-config",
            metadata={"name": f"{object_name}-config-{config_sha[:10]}", "namespace": args.namespace,
                      "labels": labels},
            data={SERVER_CONFIG_FILE: server_yaml},
            immutable=True,
            opts=child,
        )

        self.cache_claim = None
        if spec.weight_cache == "pvc":
            claim: k8s.core.v1.PersistentVolumeClaimSpecArgsDict = {
                # Shared by every replica of the slot: the first pull fills it, the others find the
                # verified version and return at once. Needs a ReadWriteMany class (EFS, Filestore, NFS).
                "access_modes": ["ReadWriteMany"],
                "resources": {"requests": {"storage": spec.weight_cache_size}},
            }
            if spec.storage_class:
                claim["storage_class_name"] = spec.storage_class
            self.cache_claim = k8s.core.v1.PersistentVolumeClaim(
                f"{name}-weights",
                metadata={"name": f"{object_name}-weights", "namespace": args.namespace, "labels": labels},
                spec=claim,
                opts=child,
            )

        security_context: k8s.core.v1.SecurityContextArgsDict = {
            "allow_privilege_escalation": False,
            "read_only_root_filesystem": True,
            "run_as_non_root": True,
            "capabilities": {"drop": ["ALL"]},
        }
        init_containers = [_pull("pull-target", args.spec.image, args.spec.model_version, target_dir, spec,
                                 security_context)]
        if draft_dir and args.spec.draft_version:
            init_containers.append(
                _pull("pull-draft", args.spec.image, args.spec.draft_version, draft_dir, spec, security_context)
            )

        resources: dict[str, str] = {"cpu": spec.cpu, "memory": spec.memory}
        if spec.gpus_per_pod:
            resources["nvidia.com/gpu"] = str(spec.gpus_per_pod)
        startup_budget = startup_budget_s(config)
        rollout_budget = startup_budget + PULL_ALLOWANCE_S
        server: k8s.core.v1.ContainerArgsDict = {
            "name": "server",
            "image": args.spec.image,
            "command": ["specdeploy", "serve", "--config", f"{CONFIG_DIR}/{SERVER_CONFIG_FILE}"],
            "ports": [{"name": HTTP_PORT_NAME, "container_port": config.service.port, "protocol": "TCP"}],
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
        volumes: list[k8s.core.v1.VolumeArgsDict] = [
            {"name": "config", "config_map": {"name": metadata_name(self.config_map)}},
            # Referenced, never rendered: the Secret exists in the namespace before `pulumi up`.
            {"name": "api-keys", "secret": {"secret_name": spec.api_key_secret,
                                            "items": [{"key": API_KEYS_SECRET_KEY, "path": API_KEYS_SECRET_KEY}]}},
            _cache_volume(slot, spec),
            {"name": "tmp", "empty_dir": {"size_limit": "1Gi"}},
            {"name": "dshm", "empty_dir": {"medium": "Memory", "size_limit": "2Gi"}},
        ]
        pod_spec: k8s.core.v1.PodSpecArgsDict = {
            "service_account_name": args.service_account_name,
            "automount_service_account_token": False,
            "security_context": {
                "run_as_non_root": True,
                "run_as_user": RUN_AS_USER,
                "run_as_group": RUN_AS_USER,
                "fs_group": RUN_AS_USER,
                "fs_group_change_policy": "OnRootMismatch",
                "seccomp_profile": {"type": "RuntimeDefault"},
            },
            "termination_grace_period_seconds": termination_grace_s(config),
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

        self.deployment = k8s.apps.v1.Deployment(
            f"{name}-deployment",
            metadata={"name": object_name, "namespace": args.namespace, "labels": labels},
            spec={
                "replicas": spec.min_replicas,
                "selector": {"match_labels": server_selector(slot)},
                # A new pod must be ready before an old one goes: capacity never dips during a rollout.
                "strategy": {"type": "RollingUpdate", "rolling_update": {"max_surge": 1, "max_unavailable": 0}},
                "progress_deadline_seconds": rollout_budget,
                "template": {
                    "metadata": {"labels": labels},
                    "spec": pod_spec,
                },
            },
            opts=pulumi.ResourceOptions(
                parent=self,
                # The autoscaler owns the replica count after creation.
                ignore_changes=["spec.replicas"],
                # `pulumi up` waits for the rollout (pull + load + warm-up), not pulumi-kubernetes' 10 minutes.
                custom_timeouts=pulumi.CustomTimeouts(create=f"{rollout_budget}s", update=f"{rollout_budget}s"),
            ),
        )
        self.deployment_name = metadata_name(self.deployment)

        self.service = k8s.core.v1.Service(
            f"{name}-service",
            metadata={"name": object_name, "namespace": args.namespace, "labels": labels},
            spec={
                "type": "ClusterIP",
                "selector": server_selector(slot),
                "ports": [{"name": HTTP_PORT_NAME, "port": config.service.port, "target_port": HTTP_PORT_NAME,
                           "protocol": "TCP"}],
            },
            opts=child,
        )
        self.service_name = metadata_name(self.service)

        self.register_outputs({"deployment_name": self.deployment_name, "service_name": self.service_name})
