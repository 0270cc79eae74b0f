"""Names, labels and small conversions shared by the Kubernetes components.

Not a component: the components beside it import these so that a label
or a path is spelled once (a Service selector that drifts from its pod labels
routes nothing, silently).
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any

import pulumi

from infra.config import MODEL_CACHE_DIR, KubernetesSpec, StackConfig

APP = "specdeploy"
SERVER_COMPONENT = "server"
SLOT_LABEL = "specdeploy.dev/slot"
HTTP_PORT_NAME = "http"

# Paths inside the pod.
CONFIG_DIR = "/etc/specdeploy"
SERVER_CONFIG_FILE = "server.yaml"
SECRETS_DIR = "/etc/specdeploy/secrets"
# Key of the existing API-key Secret that holds `id:key[:rpm]` lines (mounted as a file, never an env var).
API_KEYS_SECRET_KEY = "api-keys"
# Key of the same Secret holding one bearer key Prometheus scrapes /metrics with (metrics_require_auth).
METRICS_KEY_SECRET_KEY = "metrics-key"

# Seconds the pod keeps serving after it is marked terminating, so the ingress controller and
# kube-proxy drop the endpoint before the server stops admitting (endpoint removal is asynchronous).
PRE_STOP_DELAY_S = 5
# Slack between the server's own drain deadline and SIGKILL.
TERMINATION_SLACK_S = 10

_BYTES_PER_PARAM = {"fp32": 4, "fp16": 2, "bf16": 2}
# Conservative rate of reading weights from the cache volume into GPU memory (network volumes).
_LOAD_BYTES_PER_S = 0.5e9
# CUDA context, allocator reservation, KV cache allocation and the warm-up generation.
_WARMUP_S = 300


def kubernetes_spec(config: StackConfig) -> KubernetesSpec:
    """The stack's `kubernetes` section; the components cannot be built without it."""
    if config.kubernetes is None:
        raise ValueError("platform 'kubernetes' needs a `kubernetes` section in the stack file")
    return config.kubernetes


def app_labels(component: str) -> dict[str, str]:
    """Labels on every object of one component (recommended Kubernetes labels)."""
    return {
        "app.kubernetes.io/name": APP,
        "app.kubernetes.io/part-of": APP,
        "app.kubernetes.io/managed-by": "pulumi",
        "app.kubernetes.io/component": component,
    }


def server_selector(slot: str | None = None) -> dict[str, str]:
    """Pod selector of the server pods, of one slot or of all slots."""
    selector = {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": SERVER_COMPONENT}
    if slot is not None:
        selector[SLOT_LABEL] = slot
    return selector


def slot_labels(slot: str) -> dict[str, str]:
    return {**app_labels(SERVER_COMPONENT), SLOT_LABEL: slot}


def slot_object_name(slot: str) -> str:
    """Physical name of a slot's Deployment, Service, HPA and PDB."""
    return f"{APP}-{slot}"


def cache_dir(uri: str) -> str:
    """Directory of one model version in the weight cache, unique per URI.

    Keyed by version rather than by slot, so a shared cache (PVC, hostPath) keeps the
    previous version for a rollback and two slots never overwrite each other.
    """
    parts = [p for p in uri.split("://", 1)[-1].split("/") if p]
    readable = re.sub(r"[^a-z0-9.-]+", "-", "-".join(parts[-2:]).lower()).strip("-.")[:60]
    digest = hashlib.sha256(uri.encode()).hexdigest()[:10]
    return f"{MODEL_CACHE_DIR}/{readable}-{digest}" if readable else f"{MODEL_CACHE_DIR}/{digest}"


def startup_budget_s(config: StackConfig) -> int:
    """Seconds the startup probe allows for loading weights into GPU memory and warming up.

    The weight pull itself runs in the init containers, before any probe starts.
    """
    spec = config.kubernetes
    if spec is not None and spec.startup_budget_s is not None:
        return spec.startup_budget_s
    models = [config.model] + ([config.draft] if config.draft is not None else [])
    if any(model.params_b is None for model in models):
        return config.fleet.warmup_s
    weight_bytes = sum((model.params_b or 0) * 1e9 * _BYTES_PER_PARAM[model.dtype] for model in models)
    return max(300, math.ceil(weight_bytes / _LOAD_BYTES_PER_S) + _WARMUP_S)


def termination_grace_s(config: StackConfig) -> int:
    """preStop delay + the server's drain grace + slack: SIGKILL never cuts a drain short."""
    return PRE_STOP_DELAY_S + math.ceil(config.service.drain_grace_s) + TERMINATION_SLACK_S


def quantity(value: float) -> str:
    """A Kubernetes quantity string: 8 -> "8", 2.5 -> "2500m"."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"


def metadata_name(resource: Any) -> pulumi.Output[str]:
    """The name of a created Kubernetes object, as an output that depends on it."""
    metadata: pulumi.Output[Any] = resource.metadata
    return metadata.apply(lambda m: str(m.name))
