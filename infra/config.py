"""The stack schema: the whole deployment intent of one environment, validated once.

``stacks/Pulumi.<env>.yaml`` holds it under ``config:`` with one project key per
section (``specdeploy:model``, ``specdeploy:fleet``, ...). The Pulumi program, the
local platform, the launch validation and the release tooling all read it
through :class:`StackConfig`; the server's own config file is rendered from it
(:func:`render_server_config`), never written twice by hand.

This module imports neither pulumi nor torch: ``specdeploy config validate``
must start in a fraction of a second.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from serving.config import (
    ConfigError,
    ModelSection,
    NumThreads,
    Precision,
    Quantization,
    SchedulerSection,
    ServerConfig,
    ServiceSection,
    SpeculativePolicy,
    StrictModel,
    TensorParallelSize,
    format_validation_error,
    section_field,
)

PROJECT = "specdeploy"
# The source checkout this module sits in: only for in-repo resources (the config reference
# generator). Stack files come from the user's Pulumi project, see :func:`project_dir`.
REPO_ROOT = Path(__file__).resolve().parent.parent
PROJECT_FILE = "Pulumi.yaml"

# Where the server finds its models on a host or in a pod; the weight pull writes here.
MODEL_CACHE_DIR = "/data/models"

_URI = re.compile(r"^(s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?|file://.+)$")
Slot = Literal["blue", "green"]
SLOTS: tuple[Slot, Slot] = ("blue", "green")  # the two release slots; import this, never retype it
Platform = Literal["local", "aws", "kubernetes"]
_ECR_REPOSITORY = r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*$"
OPEN_CIDRS = frozenset({"0.0.0.0/0", "::/0"})  # "anyone"


def _check_uri(value: str) -> str:
    if not _URI.match(value):
        raise ValueError(f"{value!r} is not a weights URI; use s3://bucket/prefix or file:///path")
    return value


class ModelSpec(StrictModel):
    """A model version in the weight store, plus the dimensions the capacity plan needs
    when its config.json cannot be read (a private bucket at review time)."""

    name: str = Field(..., min_length=1, description="Model id served in the API (`model` field).")
    source: str = Field(..., description="Weights URI of this version: s3://bucket/prefix or file:///dir.")
    dtype: Precision = Field("bf16", description="Serving precision (the capacity plan sizes the fleet by it).")
    quantization: Quantization = section_field(ModelSection, "quantization")
    tensor_parallel_size: TensorParallelSize = section_field(ModelSection, "tensor_parallel_size")
    num_threads: NumThreads = section_field(ModelSection, "num_threads")
    params_b: float | None = Field(None, gt=0, description="Parameter count in billions (capacity plan).")
    num_layers: int | None = Field(None, gt=0, description="Decoder layers (capacity plan).")
    hidden_size: int | None = Field(None, gt=0, description="Model width (capacity plan).")
    num_attention_heads: int | None = Field(None, gt=0, description="Query heads (capacity plan).")
    num_kv_heads: int | None = Field(None, gt=0, description="Key/value heads; GQA when below query heads.")
    head_dim: int | None = Field(None, gt=0, description="Per-head width; default hidden / heads.")
    vocab_size: int | None = Field(None, gt=0, description="Vocabulary size (capacity plan: embedding and lm_head, "
                                   "which every tensor-parallel rank holds whole).")
    tie_word_embeddings: bool = Field(False, description="One table for embedding and lm_head (capacity plan).")

    @field_validator("source")
    @classmethod
    def _source_uri(cls, value: str) -> str:
        return _check_uri(value)


# The stack's `speculative` section is the server's, less the draft model's path (the deployment knows it).
SpeculativeSpec = SpeculativePolicy


class ServiceSpec(StrictModel):
    """The server settings a stack may set; each field is the server config's own (bounds, default)."""

    port: int = section_field(ServiceSection, "port")
    drain_grace_s: float = section_field(ServiceSection, "drain_grace_s")
    metrics_require_auth: bool = section_field(ServiceSection, "metrics_require_auth")
    max_memory_utilization: float = section_field(ModelSection, "max_memory_utilization")


class FleetSpec(StrictModel):
    instance_type: str = Field("auto", description="EC2 type, or `auto` for the cheapest that fits the plan.")
    min_size: int = Field(1, ge=0, le=1000, description="Baseline instances; scale-in never goes below.")
    max_size: int = Field(2, ge=1, le=1000, description="Upper bound of the autoscaling group.")
    desired_capacity: int | None = Field(None, ge=0, description="Initial size; default min_size.")
    capacity_type: Literal["on-demand", "spot", "mixed"] = Field(
        "on-demand", description="Purchase option; spot suits offline batch stacks."
    )
    on_demand_base: int = Field(1, ge=0, description="On-demand instances kept under `mixed`.")
    ami_id: str | None = Field(None, description="Fixed AMI id; default: the GPU AMI from ami_ssm_parameter.")
    ami_ssm_parameter: str = Field(
        "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id",
        description="SSM parameter resolving the GPU (Deep Learning Base) AMI.",
    )
    root_volume_gb: int = Field(200, ge=30, le=16384, description="Encrypted gp3 root, sized for weights.")
    warmup_s: int = Field(900, ge=60, description="Grace period for weight pull, load and warm-up.")
    queue_target_per_instance: float = Field(
        8.0, gt=0, description="Target tracking: waiting requests per instance."
    )
    scale_schedules: list[ScaleSchedule] = Field(
        default_factory=list, description="Known peaks: cron schedules raising min_size."
    )
    nvidia_driver_min: str | None = Field(None, description="Minimum driver version checked at boot.")
    image_repository: str | None = Field(
        None, max_length=256, pattern=_ECR_REPOSITORY,
        description="ECR repository name for the image; default specdeploy-<stack> (one per stack and account).",
    )

    @model_validator(mode="after")
    def _sizes(self) -> FleetSpec:
        if self.min_size > self.max_size:
            raise ValueError(f"fleet.min_size ({self.min_size}) exceeds fleet.max_size ({self.max_size})")
        desired = self.desired_capacity
        if desired is not None and not self.min_size <= desired <= self.max_size:
            raise ValueError(f"fleet.desired_capacity ({desired}) must lie in [min_size, max_size]")
        for index, schedule in enumerate(self.scale_schedules):
            if schedule.min_size > self.max_size:
                raise ValueError(f"fleet.scale_schedules[{index}].min_size ({schedule.min_size}) exceeds "
                                 f"fleet.max_size ({self.max_size})")
        return self


class ScaleSchedule(StrictModel):
    name: str = Field(..., pattern=r"^[a-z0-9-]+$", description="Schedule name.")
    cron: str = Field(..., description="Cron expression (UTC) when it applies.")
    min_size: int = Field(..., ge=0, description="Baseline during the peak.")


class AccessSpec(StrictModel):
    public: bool = Field(False, description="Internet-facing load balancer / ingress (needs TLS).")
    allowed_cidrs: list[str] = Field(
        default_factory=lambda: ["10.0.0.0/8"], min_length=1, description="Client CIDRs allowed to reach the endpoint."
    )
    certificate_arn: str | None = Field(None, description="ACM certificate for HTTPS (aws, required if public).")
    domain: str | None = Field(None, description="DNS name clients use (informational / ingress host).")
    vpc_id: str | None = Field(None, description="Existing VPC; default: create one.")
    private_subnet_ids: list[str] = Field(default_factory=list, description="Subnets for the instances.")
    public_subnet_ids: list[str] = Field(default_factory=list, description="Subnets for a public ALB.")

    @field_validator("allowed_cidrs")
    @classmethod
    def _cidrs(cls, values: list[str]) -> list[str]:
        for value in values:
            try:
                ipaddress.ip_network(value, strict=False)
            except ValueError as exc:
                raise ValueError(f"{value!r} is not a CIDR block") from exc
        return values

    @model_validator(mode="after")
    def _subnets(self) -> AccessSpec:
        if self.vpc_id and not self.private_subnet_ids:
            raise ValueError("access.private_subnet_ids is required when access.vpc_id is given")
        if self.vpc_id and self.public and not self.public_subnet_ids:
            raise ValueError("access.public_subnet_ids is required for a public service in an existing VPC")
        return self


class AlertingSpec(StrictModel):
    emails: list[str] = Field(default_factory=list, description="Email addresses subscribed to alerts.")
    https_endpoints: list[str] = Field(default_factory=list, description="HTTPS webhooks (pager, chat).")
    runbook_base_url: str = Field(
        "https://github.com/specdeploy/specdeploy/blob/main/runbooks",
        description="Base URL of runbooks/; each alarm links <base>/<AlarmName>.md.",
    )
    gpu_memory_warn_ratio: float = Field(0.85, gt=0, le=1, description="GPU memory share that warns (guide).")
    gpu_utilization_high_ratio: float = Field(0.95, gt=0, le=1, description="Sustained GPU busy share.")
    error_rate_critical: float = Field(0.01, gt=0, le=1, description="5xx share that pages (guide: 1 %).")
    p99_latency_s: float = Field(30.0, gt=0, description="P99 end-to-end latency threshold.")
    p99_ttft_s: float = Field(2.0, gt=0, description="P99 time-to-first-token threshold.")
    queue_length_warn: int = Field(32, ge=1, description="Waiting requests per instance that warn.")
    evaluation_minutes: int = Field(5, ge=1, le=60, description="Minutes a condition must hold.")

    @field_validator("https_endpoints")
    @classmethod
    def _https(cls, values: list[str]) -> list[str]:
        for value in values:
            if not value.startswith("https://"):
                raise ValueError(f"{value!r} must be an https:// URL")
        return values


class SloSpec(StrictModel):
    """Targets the launch validation gates on (the guide: compare every figure with a target)."""

    ttft_p99_ms: float = Field(2000, gt=0, description="P99 time to first token.")
    tpot_p99_ms: float = Field(200, gt=0, description="P99 time per output token after the first.")
    e2e_p99_s: float = Field(30, gt=0, description="P99 end-to-end latency.")
    min_tokens_per_s: float = Field(0, ge=0, description="Aggregate generated tokens/s at target load.")
    max_error_rate: float = Field(0.0, ge=0, le=1, description="Error share allowed under target load.")
    target_concurrency: int = Field(8, ge=1, description="Concurrency at which the SLOs must hold.")
    memory_slope_mb_per_min: float = Field(5.0, gt=0, description="Soak: RSS growth above this is a leak.")


class SlotServerSpec(StrictModel):
    """A slot's own server settings: keys of the stack's `scheduler` / `speculative` sections that differ on
    this slot. A change made here lands on this slot only, and reaches traffic only through a rollout."""

    scheduler: dict[str, Any] | None = Field(
        None, description="Keys of `scheduler` (e.g. max_concurrency) this slot serves with instead.")
    speculative: dict[str, Any] | None = Field(
        None, description="Keys of `speculative` (e.g. enabled, num_draft_tokens) this slot serves with instead.")


class SlotSpec(StrictModel):
    image: str = Field(..., min_length=1, description="Server image, by digest in production.")
    model_version: str = Field(..., description="Weights URI of the model version this slot serves.")
    draft_version: str | None = Field(None, description="Weights URI of the draft version, if any.")
    ami: str | None = Field(
        None, pattern=r"^ami-[0-9a-f]{8,17}$",
        description="AMI of this slot's instances (aws); default: fleet.ami_id, else resolved from SSM while the "
                    "slot is idle and kept while it carries traffic.",
    )
    server: SlotServerSpec | None = Field(
        None, description="Server settings of this slot over the stack's `scheduler` and `speculative`: the way "
                          "to canary a config change (set it on the idle slot, `pulumi up`, `specdeploy rollout`).",
    )

    @field_validator("model_version", "draft_version")
    @classmethod
    def _version_uri(cls, value: str | None) -> str | None:
        return value if value is None else _check_uri(value)


class ReleaseSpec(StrictModel):
    active: Slot = Field("blue", description="Slot taking (most) traffic.")
    canary_weight: int = Field(0, ge=0, le=100, description="Percent of traffic on the idle slot.")
    blue: SlotSpec | None = Field(None, description="The blue slot.")
    green: SlotSpec | None = Field(None, description="The green slot (absent until a release).")
    gate_cidrs: list[str] | None = Field(
        None, max_length=4,
        description="Where release gates run from. aws: each slot's gate listener on the load balancer admits "
                    "these (default access.allowed_cidrs on an internal load balancer, none on a public one); "
                    "kubernetes: a NetworkPolicy rule admits them to the server port of the pods, whose "
                    "addresses the gates then use (pod IPs routable from there, e.g. the EKS VPC CNI).",
    )

    @field_validator("gate_cidrs")
    @classmethod
    def _cidrs(cls, value: list[str] | None) -> list[str] | None:
        import ipaddress

        for cidr in value or []:
            try:
                ipaddress.ip_network(cidr, strict=True)
            except ValueError as exc:
                raise ValueError(f"release.gate_cidrs: {cidr!r} is not a CIDR block ({exc})") from None
            if ipaddress.ip_network(cidr).prefixlen == 0:
                raise ValueError(f"release.gate_cidrs: {cidr} opens the slots' gate paths to the world; "
                                 "list the networks operators and pipelines run from")
        return value

    @model_validator(mode="after")
    def _active_exists(self) -> ReleaseSpec:
        if getattr(self, self.active) is None:
            raise ValueError(f"release.active is {self.active!r} but release.{self.active} is not defined")
        idle = self.idle_slot
        if self.canary_weight and (idle is None or getattr(self, idle) is None):
            raise ValueError("release.canary_weight > 0 needs both slots defined")
        return self

    @property
    def idle_slot(self) -> Slot | None:
        return "green" if self.active == "blue" else "blue"

    def weights(self) -> dict[str, int]:
        """Percent of traffic per slot as the stack file records it."""
        idle = "green" if self.active == "blue" else "blue"
        return {self.active: 100 - self.canary_weight, idle: self.canary_weight}

    def carries_traffic(self, name: str) -> bool:
        return self.weights().get(name, 0) > 0

    def slot(self, name: str) -> SlotSpec | None:
        if name not in SLOTS:
            raise ValueError(f"unknown slot {name!r}; allowed: {', '.join(SLOTS)}")
        spec: SlotSpec | None = getattr(self, name)
        return spec


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


class LocalSpec(StrictModel):
    state_dir: str = Field(".specdeploy/local", description="Pid, log, rendered config and weight cache.")
    host: str = Field("127.0.0.1", description="Loopback address the local server binds.")
    kv_cache_mb: int = Field(256, ge=1, description="KV cache budget on CPU, in MiB.")
    runtime: Literal["process", "container"] = Field(
        "process", description="`process`: the server runs from this checkout; `container`: from `image` (podman)."
    )
    image: str = Field("localhost/specdeploy-server:cpu", description="Server image for runtime `container`.")


class StackConfig(StrictModel):
    """One environment's intent. Each field is one `specdeploy:<key>` in the stack file."""

    platform: Platform = Field(..., description="Where the service runs: local, aws or kubernetes.")
    model: ModelSpec = Field(..., description="Target model: source, dtype, dimensions for planning.")
    draft: ModelSpec | None = Field(None, description="Draft model for speculative decoding.")
    speculative: SpeculativeSpec = Field(default_factory=SpeculativeSpec, description="Speculation.")
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection, description="Server limits.")
    service: ServiceSpec = Field(default_factory=ServiceSpec, description="Server process settings.")
    fleet: FleetSpec = Field(default_factory=FleetSpec, description="AWS instances and autoscaling.")
    access: AccessSpec = Field(default_factory=AccessSpec, description="Network exposure and TLS.")
    alerting: AlertingSpec = Field(default_factory=AlertingSpec, description="Alarm targets, thresholds.")
    slo: SloSpec = Field(default_factory=SloSpec, description="Targets for launch validation.")
    release: ReleaseSpec | None = Field(None, description="Blue/green slots; default: blue = model.")
    kubernetes: KubernetesSpec | None = Field(None, description="Cluster settings (platform kubernetes).")
    local: LocalSpec = Field(default_factory=LocalSpec, description="Local platform settings.")
    api_keys: str | None = Field(
        None, description="Secret: API keys `id:key[:rpm]`, comma separated (set with --secret)."
    )

    @model_validator(mode="after")
    def _coherent(self) -> StackConfig:
        if self.speculative.uses_draft_model and self.draft is None:
            raise ValueError("speculative.method is 'draft' but no `draft` model is configured")
        if self.platform == "kubernetes" and self.kubernetes is None:
            raise ValueError("platform 'kubernetes' needs a `kubernetes` section")
        if self.platform == "aws" and self.access.public and not self.access.certificate_arn:
            raise ValueError("access.public on aws needs access.certificate_arn (TLS when public)")
        if self.platform == "aws" and not self.alerting.emails and not self.alerting.https_endpoints:
            raise ValueError("platform aws needs alerting.emails or alerting.https_endpoints: "
                             "alarms would reach nobody")
        if self.platform == "kubernetes" and self.access.public and not (
            self.kubernetes and self.kubernetes.tls_secret
        ):
            raise ValueError("access.public on kubernetes needs kubernetes.tls_secret (TLS when public)")
        if self.draft is not None and self.draft.dtype != self.model.dtype:
            raise ValueError(
                f"draft.dtype ({self.draft.dtype}) differs from model.dtype ({self.model.dtype})"
            )
        if self.draft is not None and self.draft.quantization != "none":
            raise ValueError("draft.quantization: only the target's weights are quantized; leave it none")
        if self.draft is not None and self.draft.tensor_parallel_size != 1:
            raise ValueError("draft.tensor_parallel_size: the draft model is not sharded; leave it 1")
        if self.draft is not None and self.draft.num_threads != "auto":
            raise ValueError("draft.num_threads: threads are the server process's, shared by target and draft; "
                             "set model.num_threads")
        k8s = self.kubernetes
        tp = self.model.tensor_parallel_size
        if self.platform == "kubernetes" and k8s is not None and tp > 1 and k8s.gpus_per_pod < tp:
            raise ValueError(
                f"kubernetes.gpus_per_pod ({k8s.gpus_per_pod}) is below model.tensor_parallel_size "
                f"({self.model.tensor_parallel_size}): each pod needs one GPU per tensor-parallel rank"
            )
        self._check_slots_have_drafts()
        self._check_platform_access()
        return self

    def _check_slots_have_drafts(self) -> None:
        for name in SLOTS:
            slot = self.slots.slot(name)
            if slot is None:
                continue
            serving = self.for_slot(name)  # validates the slot's own server settings
            if self.platform == "local" or not serving.speculative.uses_draft_model:
                continue
            if self.draft is None:
                raise ValueError(f"release.{name}.server.speculative uses a draft model but no `draft` is configured")
            if slot.draft_version is None:
                raise ValueError(f"release.{name}.draft_version is required: speculative.method is 'draft'")

    def for_slot(self, name: str) -> StackConfig:
        """This stack as slot `name` serves it: its `release.<name>.server` keys over `scheduler` and
        `speculative`. The same object when the slot has no settings of its own."""
        spec = self.slots.slot(name)
        own = spec.server if spec is not None else None
        if own is None or (not own.scheduler and not own.speculative):
            return self
        update: dict[str, Any] = {}
        for section, model, current in (("scheduler", SchedulerSection, self.scheduler),
                                        ("speculative", SpeculativeSpec, self.speculative)):
            keys = getattr(own, section)
            if not keys:
                continue
            try:
                update[section] = model.model_validate({**current.model_dump(), **keys})
            except ValidationError as exc:
                problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
                raise ValueError(f"release.{name}.server.{section}: {problems}") from None
        return self.model_copy(update=update)

    def _check_platform_access(self) -> None:
        open_cidrs = OPEN_CIDRS & set(self.access.allowed_cidrs)
        if self.platform == "aws":
            if open_cidrs and not self.access.public:
                raise ValueError("access.allowed_cidrs opens an internal load balancer to the world; "
                                 "set access.public or list the client networks")
        if self.kubernetes is not None and self.kubernetes.routing == "gateway-api" and not open_cidrs:
            # An HTTPRoute has no portable source filter: refuse to pretend the allow-list is enforced.
            raise ValueError(
                "access.allowed_cidrs cannot be enforced by an HTTPRoute (kubernetes.routing gateway-api): "
                "restrict sources on the Gateway and set access.allowed_cidrs to [0.0.0.0/0]"
            )

    @property
    def serves_on_gpu(self) -> bool:
        """AWS fleets and Kubernetes pods with GPUs: the server must run on CUDA (`model.device: cuda`)."""
        k8s = self.kubernetes
        return self.platform == "aws" or (self.platform == "kubernetes" and k8s is not None and k8s.gpus_per_pod > 0)

    @property
    def uses_draft_model(self) -> bool:
        """Speculation on, by a draft model, and one is configured: the draft is pulled, planned for, served."""
        return self.speculative.uses_draft_model and self.draft is not None

    @property
    def slots(self) -> ReleaseSpec:
        """The release slots; a stack without `release` serves `model` from blue."""
        if self.release is not None:
            return self.release
        return ReleaseSpec(
            active="blue",
            blue=SlotSpec(
                image="specdeploy-server:latest",
                model_version=self.model.source,
                draft_version=self.draft.source if self.draft else None,
            ),
        )


FleetSpec.model_rebuild()

# Stack-file key (camelCase, as Pulumi config keys are written) -> StackConfig field.
_KEY_ALIASES = {"apiKeys": "api_keys"}
_FIELD_KEYS = {field: key for key, field in _KEY_ALIASES.items()}
SECRET_FIELDS = frozenset({"api_keys"})
_OPTIONAL_FIELDS = frozenset(name for name, f in StackConfig.model_fields.items() if f.default is None)
SECRET_MASK = "[secret]"


def config_key(field: str) -> str:
    """The stack-file key of a StackConfig field (`api_keys` -> `apiKeys`)."""
    return _FIELD_KEYS.get(field, field)


class StackFile:
    """A parsed stack file: project config (typed), provider config, and which keys are secret."""

    def __init__(self, name: str, path: Path, config: StackConfig, providers: dict[str, Any],
                 secret_keys: frozenset[str]) -> None:
        self.name = name
        self.path = path
        self.config = config
        self.providers = providers
        self.secret_keys = secret_keys


def _parse_value(raw: Any) -> Any:
    # The CLI stores structured values as YAML; Pulumi passes them to programs as JSON text.
    if isinstance(raw, str) and raw[:1] in "[{":
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def parse_stack_mapping(raw: Mapping[str, Any], source: str = "stack") -> tuple[
        StackConfig, dict[str, Any], frozenset[str]]:
    """Validate the `config:` mapping of a stack file.

    Returns the typed config, provider settings (e.g. ``aws:region``) and the
    set of secret field names. Secure values cannot be decrypted without the
    Pulumi CLI, so they are kept as a masked placeholder.
    """
    project: dict[str, Any] = {}
    providers: dict[str, Any] = {}
    secrets: set[str] = set()
    for full_key, value in raw.items():
        namespace, sep, key = str(full_key).partition(":")
        if not sep:
            namespace, key = PROJECT, namespace
        if namespace != PROJECT:
            providers[f"{namespace}:{key}"] = value
            continue
        field = _KEY_ALIASES.get(key, key)
        if isinstance(value, Mapping) and set(value) == {"secure"}:
            secrets.add(field)
            value = SECRET_MASK
        value = _parse_value(value)
        if value in ({}, "", None) and field in _OPTIONAL_FIELDS:
            continue  # Pulumi.yaml declares optional sections with an empty default
        project[field] = value
    unknown = sorted(set(project) - set(StackConfig.model_fields))
    if unknown:
        allowed = ", ".join(f"{PROJECT}:{config_key(f)}" for f in StackConfig.model_fields)
        raise ConfigError(
            f"{source}: unknown key {', '.join(f'{PROJECT}:{k}' for k in unknown)}; allowed keys: {allowed}"
        )
    try:
        config = StackConfig.model_validate(project)
    except ValidationError as exc:
        raise ConfigError(f"{source}:\n{format_validation_error(exc, prefix=f'{PROJECT}:')}") from exc
    return config, providers, frozenset(secrets | (SECRET_FIELDS & set(project)))


# `specdeploy --project DIR` pins the project; otherwise it is found from the working directory.
_pinned_project: Path | None = None


def find_project_dir(start: Path) -> Path:
    """The Pulumi project ``start`` is in: ``start`` or its nearest parent holding a Pulumi.yaml,
    as the ``pulumi`` command finds it."""
    start = start.resolve()
    for directory in (start, *start.parents):
        if (directory / PROJECT_FILE).is_file():
            return directory
    raise ConfigError(f"no {PROJECT_FILE} in {start} or any parent; run inside a specdeploy project "
                      "or pass --project DIR")


def use_project(directory: Path | None) -> None:
    """Pin the project directory for this process (``--project DIR``); None finds it from the cwd again."""
    global _pinned_project
    if directory is not None and not (directory / PROJECT_FILE).is_file():
        raise ConfigError(f"--project {directory}: no {PROJECT_FILE} there")
    _pinned_project = directory.resolve() if directory is not None else None


def project_dir() -> Path:
    """The Pulumi project: pinned by ``--project``, else found upward from the working directory."""
    return _pinned_project or find_project_dir(Path.cwd())


def project_stacks_dir(project: Path | None = None) -> Path:
    """Where the project's stack files live: Pulumi.yaml's ``stackConfigDir``, default the project itself."""
    project = project or project_dir()
    path = project / PROJECT_FILE
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: expected a mapping")
    configured = document.get("stackConfigDir")
    if configured is None:
        return project
    if not isinstance(configured, str) or not configured:
        raise ConfigError(f"{path}: stackConfigDir must be a directory path, got {configured!r}")
    return project / configured


def stack_path(name: str, stacks_dir: Path | None = None) -> Path:
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise ConfigError(f"invalid stack name {name!r}")
    return (stacks_dir or project_stacks_dir()) / f"Pulumi.{name}.yaml"


def available_stacks(stacks_dir: Path | None = None) -> list[str]:
    directory = stacks_dir or project_stacks_dir()
    return sorted(p.name[len("Pulumi.") : -len(".yaml")] for p in directory.glob("Pulumi.*.yaml"))


def load_stack(name: str, stacks_dir: Path | None = None) -> StackFile:
    """Read and validate ``Pulumi.<name>.yaml`` of the project's stack directory (or ``stacks_dir``)."""
    path = stack_path(name, stacks_dir)
    if not path.is_file():
        known = ", ".join(available_stacks(stacks_dir)) or "none"
        raise ConfigError(f"stack {name!r}: {path} does not exist (known stacks: {known})")
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(document, dict) or not isinstance(document.get("config"), dict):
        raise ConfigError(f"{path}: expected a top-level `config:` mapping")
    extra = sorted(set(document) - {"config", "secretsprovider", "encryptedkey", "encryptionsalt"})
    if extra:
        raise ConfigError(f"{path}: unknown top-level key(s) {', '.join(extra)}")
    config, providers, secrets = parse_stack_mapping(document["config"], source=str(path))
    return StackFile(name, path, config, providers, secrets)


def from_pulumi() -> StackConfig:
    """Read the stack through the Pulumi runtime (inside `pulumi up` / mocks)."""
    import pulumi

    cfg = pulumi.Config(PROJECT)
    raw: dict[str, Any] = {}
    for field in StackConfig.model_fields:
        key = config_key(field)
        # Secret values come back in plaintext here; components must wrap them
        # with pulumi.Output.secret before they reach any resource input.
        value = cfg.get(key)
        if value is not None:
            raw[key] = value
    config, _, _ = parse_stack_mapping(raw, source=f"stack {pulumi.get_stack()}")
    return config


def masked_dump(config: StackConfig) -> dict[str, Any]:
    """The resolved config as plain data, secrets replaced by a mask (for `config show`)."""
    data = config.model_dump(mode="json")
    for field in SECRET_FIELDS:
        if data.get(field) is not None:
            data[field] = SECRET_MASK
    return {config_key(k): v for k, v in data.items()}


def render_server_config(
    config: StackConfig,
    model_path: str = f"{MODEL_CACHE_DIR}/target",
    draft_path: str | None = f"{MODEL_CACHE_DIR}/draft",
    host: str = "0.0.0.0",
    kv_cache_bytes: int | None = None,
    api_keys_file: str | None = None,
    weights_uri: str | None = None,
) -> ServerConfig:
    """The server's config file for this stack: the single place the two schemas meet."""
    spec = config.speculative
    use_draft = config.uses_draft_model
    data = {
        "service": {
            "host": host,
            "port": config.service.port,
            "served_model_name": config.model.name,
            "metrics_require_auth": config.service.metrics_require_auth,
            "drain_grace_s": config.service.drain_grace_s,
            "api_keys_file": api_keys_file,
            "weights_uri": weights_uri,
        },
        "model": {
            "path": model_path,
            "dtype": config.model.dtype,
            # GPU platforms serve on CUDA or not at all: a CPU fallback would pass /ready and serve 100x slower.
            "device": "cuda" if config.serves_on_gpu else "auto",
            "max_memory_utilization": config.service.max_memory_utilization,
            "kv_cache_bytes": kv_cache_bytes,
            "quantization": config.model.quantization,
            "tensor_parallel_size": config.model.tensor_parallel_size,
            "num_threads": config.model.num_threads,
        },
        "scheduler": config.scheduler.model_dump(),
        "speculative": {**spec.model_dump(), "draft_model": draft_path if use_draft else None},
    }
    return ServerConfig.model_validate(data)
