"""Kubernetes: ingress-nginx canary or HTTPRoute weights, Deployment readiness, Prometheus alerts.

The routing component (``infra/components/kubernetes/routing.py``) renders a primary Ingress
to the active slot's Service and a canary Ingress (``nginx.ingress.kubernetes.io/canary``)
to the idle slot's Service whose ``canary-weight`` annotation is the idle slot's share.
Shifting traffic is one merge PATCH of that annotation. With ``kubernetes.routing:
gateway-api`` (``gateway_routing.py``) the split is the weights of one HTTPRoute's
backendRefs to the two slots' Services instead, changed by one merge PATCH of its rules. The API server is reached
with plain HTTPS (stdlib only, so the ``infra`` extra needs no Kubernetes client): in
a pod through its service account, elsewhere through the kubeconfig (token, client
certificate or an exec credential plugin such as ``aws eks get-token``).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import ssl
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from infra.components.kubernetes.common import APP, SLOT_LABEL, server_selector, slot_object_name
from infra.config import SLOTS, other_slot
from infra.ops.release.model import ReleaseError, Weights, as_slot
from infra.ops.release.traffic import FiringAlarm, SlotStatus

NGINX = "nginx.ingress.kubernetes.io"
CANARY_ANNOTATION = f"{NGINX}/canary"
CANARY_WEIGHT_ANNOTATION = f"{NGINX}/canary-weight"
CANARY_TOTAL_ANNOTATION = f"{NGINX}/canary-weight-total"
ROUTING_SELECTOR = f"app.kubernetes.io/name={APP},app.kubernetes.io/component=routing"
_SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


# --- the routing change, on plain objects (rendered manifests or API responses) ---------------

def split_routing(ingresses: Sequence[Mapping[str, Any]]) -> tuple[Mapping[str, Any], Mapping[str, Any] | None]:
    """(primary, canary) among the stack's routing Ingresses; canary is None with one slot."""
    canary = [i for i in ingresses if _annotations(i).get(CANARY_ANNOTATION) == "true"]
    primary = [i for i in ingresses if _annotations(i).get(CANARY_ANNOTATION) != "true"]
    if len(primary) != 1 or len(canary) > 1:
        names = ", ".join(str(i.get("metadata", {}).get("name")) for i in ingresses) or "none"
        raise ReleaseError(f"expected one primary and at most one canary routing Ingress, found: {names}")
    return primary[0], (canary[0] if canary else None)


def canary_slot(canary: Mapping[str, Any]) -> str:
    slot = canary.get("metadata", {}).get("labels", {}).get(SLOT_LABEL)
    if slot is None:
        raise ReleaseError(f"canary Ingress {canary['metadata'].get('name')} has no {SLOT_LABEL} label")
    return as_slot(slot)


def canary_weights(canary: Mapping[str, Any]) -> Weights:
    """The split a canary Ingress routes: its weight on its slot, the rest on the primary."""
    annotations = _annotations(canary)
    total = int(annotations.get(CANARY_TOTAL_ANNOTATION, "100"))
    weight = int(annotations.get(CANARY_WEIGHT_ANNOTATION, "0"))
    percent = round(100 * weight / total) if total else 0
    slot = canary_slot(canary)
    return {slot: percent, other_slot(slot): 100 - percent}


def canary_patch(canary: Mapping[str, Any], weights: Weights) -> dict[str, Any]:
    """JSON merge patch (RFC 7386) that makes ``canary`` route ``weights``."""
    slot = canary_slot(canary)
    return {"metadata": {"annotations": {
        CANARY_WEIGHT_ANNOTATION: str(weights[slot]),
        CANARY_TOTAL_ANNOTATION: "100",
    }}}


def _annotations(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return obj.get("metadata", {}).get("annotations") or {}


# --- the API server -----------------------------------------------------------------------------

class KubeApiError(ReleaseError):
    """An HTTP error answer of the API server; ``status`` lets callers tell 404 and 409 apart."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class KubeApi:
    """Just enough of the Kubernetes REST API: GET and PATCH JSON, bearer or client-cert auth."""

    def __init__(self, server: str, token: str | None = None, context: ssl.SSLContext | None = None) -> None:
        self.server = server.rstrip("/")
        self.token = token
        self.context = context
        self.calls: list[tuple[str, str]] = []  # (method, path) of every request, for the step log

    @classmethod
    def from_environment(cls, kubeconfig: Path | None = None, context_name: str | None = None) -> KubeApi:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if kubeconfig is None and host and (_SERVICE_ACCOUNT / "token").is_file():
            ctx = ssl.create_default_context(cafile=str(_SERVICE_ACCOUNT / "ca.crt"))
            token = (_SERVICE_ACCOUNT / "token").read_text().strip()
            return cls(f"https://{host}:{port or 443}", token, ctx)
        path = kubeconfig or Path(os.environ.get("KUBECONFIG", "~/.kube/config").split(os.pathsep)[0]).expanduser()
        if not path.is_file():
            raise ReleaseError(f"no kubeconfig at {path} and not running in a pod; pass --kubeconfig")
        return cls._from_kubeconfig(yaml.safe_load(path.read_text()) or {}, context_name, path)

    @classmethod
    def _from_kubeconfig(cls, config: Mapping[str, Any], context_name: str | None, path: Path) -> KubeApi:
        def named(section: str, name: str) -> Mapping[str, Any]:
            for entry in config.get(section) or []:
                if entry.get("name") == name:
                    return entry.get(section.rstrip("s"), {}) or {}
            raise ReleaseError(f"{path}: no {section.rstrip('s')} named {name!r}")

        context = named("contexts", context_name or config.get("current-context", ""))
        cluster = named("clusters", context["cluster"])
        user = named("users", context["user"]) if context.get("user") else {}
        ctx = ssl.create_default_context()
        if cluster.get("insecure-skip-tls-verify"):
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        elif cluster.get("certificate-authority-data"):
            ctx.load_verify_locations(cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())
        elif cluster.get("certificate-authority"):
            ctx.load_verify_locations(cafile=cluster["certificate-authority"])
        if (user.get("client-certificate") or user.get("client-certificate-data")) and \
                (user.get("client-key") or user.get("client-key-data")):
            with _material(user, "client-certificate") as cert, _material(user, "client-key") as key:
                ctx.load_cert_chain(cert, key)
        token = user.get("token")
        if not token and user.get("exec"):
            token = _exec_token(user["exec"])
        return cls(cluster["server"], token, ctx)

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json") -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.server}{path}", data=data, method=method)
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", content_type)
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        self.calls.append((method, path))
        try:
            with urllib.request.urlopen(request, timeout=30, context=self.context) as response:
                payload = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise KubeApiError(f"Kubernetes API {method} {path}: HTTP {exc.code}: {detail}", exc.code) from None
        except OSError as exc:
            raise ReleaseError(f"Kubernetes API {self.server} unreachable: {exc}") from None
        result: dict[str, Any] = json.loads(payload) if payload else {}
        return result

    def get(self, path: str, **query: str) -> dict[str, Any]:
        suffix = f"?{urllib.parse.urlencode(query)}" if query else ""
        return self.request("GET", path + suffix)

    def merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("PATCH", path, patch, "application/merge-patch+json")

    def get_text(self, path: str) -> str:
        """A non-JSON body, e.g. a pod's /metrics through the API server's proxy."""
        request = urllib.request.Request(f"{self.server}{path}")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        self.calls.append(("GET", path))
        try:
            with urllib.request.urlopen(request, timeout=30, context=self.context) as response:
                body: bytes = response.read()
        except urllib.error.HTTPError as exc:
            raise ReleaseError(f"Kubernetes API GET {path}: HTTP {exc.code}") from None
        return body.decode("utf-8", errors="replace")


@contextmanager
def _material(user: Mapping[str, Any], field: str) -> Iterator[str]:
    """A client certificate/key as a file path; inline ``-data`` lives in a private temp file meanwhile."""
    if not user.get(f"{field}-data"):
        yield str(user[field])
        return
    with tempfile.NamedTemporaryFile("wb", prefix="specdeploy-kube-") as handle:
        os.chmod(handle.name, 0o600)
        handle.write(base64.b64decode(user[f"{field}-data"]))
        handle.flush()
        yield handle.name


def _exec_token(spec: Mapping[str, Any]) -> str:
    env = {**os.environ, **{e["name"]: e["value"] for e in spec.get("env") or []}}
    result = subprocess.run([spec["command"], *(spec.get("args") or [])], capture_output=True, text=True,
                            env=env, check=False, timeout=60)
    if result.returncode != 0:
        raise ReleaseError(f"kubeconfig exec plugin {spec['command']} failed: {result.stderr.strip()[:300]}")
    token: str = json.loads(result.stdout)["status"]["token"]
    return token


# --- the routers ----------------------------------------------------------------------------------

class _SlotRouter:
    """What both routing flavours share: the slots' Deployments and pods in one namespace."""

    description: str

    def __init__(self, api: KubeApi, namespace: str) -> None:
        self.api = api
        self.namespace = namespace

    def pod_proxies(self, slot: str, port: int) -> list[str]:
        """API-server proxy paths of the slot's running pods: their /metrics without a port-forward."""
        selector = ",".join(f"{k}={v}" for k, v in server_selector(slot).items())
        pods = self.api.get(f"/api/v1/namespaces/{self.namespace}/pods", labelSelector=selector).get("items", [])
        return [f"/api/v1/namespaces/{self.namespace}/pods/{pod['metadata']['name']}:{port}/proxy"
                for pod in pods if pod.get("status", {}).get("phase") == "Running"]

    def pod_endpoints(self, slot: str, port: int) -> list[str]:
        """``http://<pod IP>:<port>`` of the slot's running, ready pods: the slot path the NetworkPolicy admits
        from ``release.gate_cidrs`` (the API server's pod proxy is not admitted)."""
        selector = ",".join(f"{k}={v}" for k, v in server_selector(slot).items())
        pods = self.api.get(f"/api/v1/namespaces/{self.namespace}/pods", labelSelector=selector).get("items", [])
        endpoints = []
        for pod in pods:
            status = pod.get("status", {})
            ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []))
            if status.get("phase") == "Running" and ready and status.get("podIP"):
                endpoints.append(f"http://{status['podIP']}:{port}")
        return endpoints

    def slot_status(self, slot: str) -> SlotStatus:
        name = slot_object_name(slot)
        try:
            deployment = self.api.get(f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{name}")
        except ReleaseError as exc:
            return SlotStatus(False, f"deployment {name}: {exc}")
        return deployment_status(deployment)


class IngressCanaryRouter(_SlotRouter):
    def __init__(self, api: KubeApi, namespace: str) -> None:
        super().__init__(api, namespace)
        self.description = f"ingress-nginx canary in namespace {namespace}"

    def _ingresses(self) -> tuple[Mapping[str, Any], Mapping[str, Any] | None]:
        listing = self.api.get(f"/apis/networking.k8s.io/v1/namespaces/{self.namespace}/ingresses",
                               labelSelector=ROUTING_SELECTOR)
        return split_routing(listing.get("items", []))

    def _canary(self) -> Mapping[str, Any]:
        _, canary = self._ingresses()
        if canary is None:
            raise ReleaseError(f"namespace {self.namespace} has no canary Ingress: define both slots in the "
                               "stack's release and run `pulumi up` before shifting traffic")
        return canary

    def weights(self) -> Weights:
        return canary_weights(self._canary())

    def set_weights(self, weights: Weights) -> None:
        canary = self._canary()
        name = canary["metadata"]["name"]
        self.api.merge_patch(f"/apis/networking.k8s.io/v1/namespaces/{self.namespace}/ingresses/{name}",
                             canary_patch(canary, weights))


# --- Gateway API: the weights of the HTTPRoute's backendRefs --------------------------------------

HTTPROUTES = "/apis/gateway.networking.k8s.io/v1/namespaces/{}/httproutes"
_SERVICE_SLOTS: dict[str, str] = {slot_object_name(slot): str(slot) for slot in SLOTS}


def the_route(routes: Sequence[Mapping[str, Any]], namespace: str) -> Mapping[str, Any]:
    """The stack's one routing HTTPRoute (``infra/components/kubernetes/gateway_routing.py``)."""
    if len(routes) != 1:
        names = ", ".join(str(r.get("metadata", {}).get("name")) for r in routes) or "none"
        raise ReleaseError(f"expected one routing HTTPRoute ({ROUTING_SELECTOR}) in namespace {namespace}, "
                           f"found: {names}; run `pulumi up` with kubernetes.routing gateway-api first")
    return routes[0]


def _slot_backends(route: Mapping[str, Any]) -> list[tuple[int, int, str]]:
    """(rule index, backend index, slot) of every backendRef that is a slot's Service."""
    found: list[tuple[int, int, str]] = []
    for r, rule in enumerate(route.get("spec", {}).get("rules") or []):
        for b, backend in enumerate(rule.get("backendRefs") or []):
            if backend.get("kind", "Service") == "Service" and backend.get("name") in _SERVICE_SLOTS:
                found.append((r, b, _SERVICE_SLOTS[backend["name"]]))
    return found


def route_weights(route: Mapping[str, Any]) -> Weights:
    """The split an HTTPRoute routes, in percent per slot; both slots must be among its backends."""
    name = route.get("metadata", {}).get("name")
    rules = route.get("spec", {}).get("rules") or []
    backends = _slot_backends(route)
    slots = {slot for _, _, slot in backends}
    if set(SLOTS) - slots:
        raise ReleaseError(f"HTTPRoute {name} has no backendRef for slot(s) {', '.join(sorted(set(SLOTS) - slots))}: "
                           "define both slots in the stack's release and run `pulumi up` before shifting traffic")
    split: Weights | None = None
    for r, rule in enumerate(rules):
        raw = {slot: int(rule["backendRefs"][b].get("weight", 1)) for rr, b, slot in backends if rr == r}
        if not raw:
            continue
        total = sum(raw.values())
        if total == 0:
            raise ReleaseError(f"HTTPRoute {name} rule {r}: every slot backend has weight 0 (no traffic served)")
        first = round(100 * raw.get(SLOTS[0], 0) / total)
        rule_split: Weights = {str(SLOTS[0]): first, str(SLOTS[1]): 100 - first}
        if split is not None and rule_split != split:
            raise ReleaseError(f"HTTPRoute {name}: its rules split traffic differently ({split} vs {rule_split}); "
                               "set one split with `pulumi up` first")
        split = rule_split
    assert split is not None  # both slots have a backend, so some rule has one
    return split


def route_patch(route: Mapping[str, Any], weights: Weights) -> dict[str, Any]:
    """JSON merge patch that makes ``route`` route ``weights``.

    A merge patch replaces lists whole, so it carries every rule with only the slot backends'
    weights changed, and the route's resourceVersion: a route changed since it was read is
    answered 409 instead of being overwritten.
    """
    rules = copy.deepcopy(list(route.get("spec", {}).get("rules") or []))
    for r, b, slot in _slot_backends(route):
        rules[r]["backendRefs"][b]["weight"] = int(weights[slot])
    patch: dict[str, Any] = {"spec": {"rules": rules}}
    version = route.get("metadata", {}).get("resourceVersion")
    if version:
        patch["metadata"] = {"resourceVersion": version}
    return patch


class HttpRouteRouter(_SlotRouter):
    """``kubernetes.routing: gateway-api``: one HTTPRoute whose backendRefs weigh the slots' Services."""

    def __init__(self, api: KubeApi, namespace: str) -> None:
        super().__init__(api, namespace)
        self.description = f"Gateway API HTTPRoute weights in namespace {namespace}"

    def _route(self) -> Mapping[str, Any]:
        listing = self.api.get(HTTPROUTES.format(self.namespace), labelSelector=ROUTING_SELECTOR)
        return the_route(listing.get("items", []), self.namespace)

    def weights(self) -> Weights:
        return route_weights(self._route())

    def set_weights(self, weights: Weights) -> None:
        route = self._route()
        name = route["metadata"]["name"]
        self.api.merge_patch(f"{HTTPROUTES.format(self.namespace)}/{name}", route_patch(route, weights))


def router_for(routing: str, api: KubeApi, namespace: str) -> IngressCanaryRouter | HttpRouteRouter:
    """The router of a stack's ``kubernetes.routing``."""
    if routing == "gateway-api":
        return HttpRouteRouter(api, namespace)
    if routing == "ingress-nginx":
        return IngressCanaryRouter(api, namespace)
    raise ReleaseError(f"kubernetes.routing {routing!r}: rollout supports ingress-nginx and gateway-api")


def deployment_status(deployment: Mapping[str, Any]) -> SlotStatus:
    """Ready = at least one ready pod, the latest spec observed and fully rolled out."""
    name = deployment.get("metadata", {}).get("name")
    spec, status = deployment.get("spec", {}), deployment.get("status", {})
    wanted = int(spec.get("replicas", 1))
    ready = int(status.get("readyReplicas", 0) or 0)
    updated = int(status.get("updatedReplicas", 0) or 0)
    observed = int(status.get("observedGeneration", 0) or 0) >= int(deployment.get("metadata", {}).get("generation", 0))
    images = sorted({c.get("image", "?") for c in spec.get("template", {}).get("spec", {}).get("containers", [])})
    detail = f"deployment {name}: {ready}/{wanted} ready, {updated} updated, image {', '.join(images)}"
    return SlotStatus(ready >= 1 and updated >= wanted and observed, detail)


PROMETHEUS_RULES = "/apis/monitoring.coreos.com/v1/namespaces/{}/prometheusrules"


class PrometheusTraffic:
    """Paging follows traffic on Kubernetes: the PrometheusRule `specdeploy-traffic` records each slot's share,
    and every slot-level alert joins on it (infra/alerts.py). One merge PATCH after each shift, as the AWS
    commands switch alarm actions; `pulumi up` leaves the rule's spec alone (ignore_changes)."""

    def __init__(self, api: Any, namespace: str, server_namespace: str | None = None) -> None:
        self.api = api
        self.namespace = namespace
        self.server_namespace = server_namespace or namespace  # the `namespace` label the alerts select

    def follow(self, weights: Weights) -> dict[str, bool]:
        from infra.alerts import TRAFFIC_RULE_NAME, traffic_rule_groups

        path = f"{PROMETHEUS_RULES.format(self.namespace)}/{TRAFFIC_RULE_NAME}"
        self.api.merge_patch(path, {"spec": {"groups": traffic_rule_groups(self.server_namespace, weights)}})
        return {str(slot): int(weights.get(slot, 0)) > 0 for slot in SLOTS}


class PrometheusAlerts:
    """The stack's PrometheusRule alerts, as Prometheus evaluates them (``/api/v1/alerts``)."""

    def __init__(self, url: str, names: Sequence[str]) -> None:
        self.url = url.rstrip("/")
        self.names = list(names)

    def watched(self) -> list[str]:
        return list(self.names)

    def firing(self) -> list[FiringAlarm]:
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/alerts", timeout=10) as response:
                alerts = json.loads(response.read())["data"]["alerts"]
        except (OSError, ValueError, KeyError) as exc:
            return [FiringAlarm("prometheus", f"cannot read alerts from {self.url}: {exc}")]
        return [
            FiringAlarm(a["labels"]["alertname"], a.get("annotations", {}).get("summary", "firing"))
            for a in alerts
            if a.get("state") == "firing" and a.get("labels", {}).get("alertname") in self.names
        ]
