"""Kubernetes routing: the canary-weight change on the objects the k8s-prod stack renders.

No cluster, kind or Docker engine is available here, so the routing change is checked
two ways instead of against a real API server: (1) on the rendered Ingress objects
themselves (the same ones `specdeploy preview --render-k8s` writes), patched and then
validated strictly with kubernetes-validate; (2) end to end through `specdeploy rollout`
/ `rollback`, with a loopback stand-in for the API server that holds those rendered
objects, applies merge patches as the API server does, and records every call.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from infra.config import load_stack
from infra.ops.cli.main import main
from infra.ops.release.kubernetes import (
    CANARY_WEIGHT_ANNOTATION,
    HTTPROUTES,
    canary_patch,
    canary_slot,
    canary_weights,
    deployment_status,
    split_routing,
)
from infra.ops.release.model import weights_to
from tests.loopback import loopback_http, reply_json

from .conftest import SlotServer, rbac_check

FAST = ["--observe", "0.5s", "--poll", "0.1s", "--skip-validation"]


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    """Every Kubernetes object of stack k8s-prod, rendered offline (blue active, 10 % canary on green)."""
    from infra.ops.k8s_render import render_objects
    from infra.program.preview import record_stack

    result = record_stack("k8s-prod")
    return render_objects((r.type, r.inputs) for r in result.resources)


def ingresses(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == "Ingress"]


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies `application/merge-patch+json`."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def test_rendered_routing_is_a_primary_and_a_canary_on_the_idle_slot(rendered: list[dict[str, Any]]) -> None:
    primary, canary = split_routing(ingresses(rendered))
    assert canary is not None
    assert canary_slot(canary) == "green"
    assert canary["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"] == "specdeploy-green"
    assert primary["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"] == "specdeploy-blue"


def test_rendered_weights_match_the_stack_file(rendered: list[dict[str, Any]]) -> None:
    _, canary = split_routing(ingresses(rendered))
    assert canary is not None
    assert canary_weights(canary) == {"green": 10, "blue": 90}
    assert load_stack("k8s-prod").config.slots.canary_weight == 10


@pytest.mark.parametrize(("slot", "percent"), [("green", 50), ("green", 100), ("blue", 100)])
def test_patched_canary_routes_the_new_weights(rendered: list[dict[str, Any]], slot: str, percent: int) -> None:
    _, canary = split_routing(ingresses(rendered))
    assert canary is not None
    patched = merge_patch(canary, canary_patch(canary, weights_to(slot, percent)))
    assert canary_weights(patched) == weights_to(slot, percent)
    # Only the weight changes: backend, host, TLS and every other annotation stay as rendered.
    unchanged = copy.deepcopy(patched)
    unchanged["metadata"]["annotations"][CANARY_WEIGHT_ANNOTATION] = canary["metadata"]["annotations"][
        CANARY_WEIGHT_ANNOTATION]
    assert unchanged == canary


@pytest.mark.parametrize("version", ["1.30", "1.33"])
def test_patched_canary_is_a_valid_ingress(rendered: list[dict[str, Any]], version: str) -> None:
    import kubernetes_validate

    _, canary = split_routing(ingresses(rendered))
    assert canary is not None
    patched = merge_patch(canary, canary_patch(canary, weights_to("blue", 100)))
    kubernetes_validate.validate(patched, version, strict=True)


def test_rendered_deployment_readiness_needs_ready_pods(rendered: list[dict[str, Any]]) -> None:
    green = next(o for o in rendered if o["kind"] == "Deployment" and o["metadata"]["name"] == "specdeploy-green")
    assert not deployment_status(green).ready  # rendered, nothing running yet
    running = {**green, "status": {"readyReplicas": 2, "updatedReplicas": 2, "observedGeneration": 1}}
    running["spec"] = {**green["spec"], "replicas": 2}
    assert deployment_status(running).ready


# --- end to end through the CLI, against a loopback API server holding the rendered objects ---------


@dataclass
class FakeApiServer:
    objects: dict[str, dict[str, Any]]  # API path -> object
    url: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)
    firing: list[str] = field(default_factory=list)  # alert names Prometheus reports firing ...
    firing_after_patches: int = 0  # ... once this many routing changes happened
    pod_metrics: SlotServer | None = None  # what green's pods answer on /metrics through the API proxy
    mutex: threading.Lock = field(default_factory=threading.Lock)  # one write at a time, as etcd orders them

    def patches(self) -> list[str]:
        """Routing changes (the traffic rule's patches that follow each of them: traffic_patches)."""
        return [path for method, path in self.calls if method == "PATCH" and "/prometheusrules/" not in path]

    def traffic_patches(self) -> list[str]:
        return [path for method, path in self.calls if method == "PATCH" and "/prometheusrules/" in path]

    def traffic(self) -> dict[str, int]:
        """The split the alerts follow: the specdeploy-traffic PrometheusRule's recorded percent per slot."""
        rule = self.objects["/apis/monitoring.coreos.com/v1/namespaces/specdeploy/prometheusrules/specdeploy-traffic"]
        return {r["labels"]["slot"]: int(r["expr"].removeprefix("vector(").removesuffix(")"))
                for r in rule["spec"]["groups"][0]["rules"]}

    def canary(self) -> dict[str, Any]:
        return self.objects["/apis/networking.k8s.io/v1/namespaces/specdeploy/ingresses/specdeploy-canary"]


def _path(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    collection = {"Ingress": "/apis/networking.k8s.io/v1/namespaces/{}/ingresses",
                  "HTTPRoute": HTTPROUTES,
                  "PrometheusRule": "/apis/monitoring.coreos.com/v1/namespaces/{}/prometheusrules",
                  "Deployment": "/apis/apps/v1/namespaces/{}/deployments"}[obj["kind"]]
    return f"{collection.format(meta['namespace'])}/{meta['name']}"


@pytest.fixture
def api_server(rendered: list[dict[str, Any]]) -> Iterator[FakeApiServer]:
    with serve_objects(rendered) as fake:
        yield fake


@contextmanager
def serve_objects(rendered: list[dict[str, Any]]) -> Iterator[FakeApiServer]:
    """A loopback stand-in for the API server holding the rendered routing objects and Deployments."""
    objects: dict[str, dict[str, Any]] = {}
    for obj in copy.deepcopy(rendered):
        if obj["kind"] in ("Ingress", "HTTPRoute", "Deployment", "PrometheusRule"):
            obj["metadata"]["resourceVersion"] = "1"
            if obj["kind"] == "Deployment":
                obj["metadata"]["generation"] = 1
                obj["status"] = {"readyReplicas": 1, "updatedReplicas": obj["spec"].get("replicas", 1),
                                 "observedGeneration": 1}
            objects[_path(obj)] = obj
    fake = FakeApiServer(objects)

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, body: Any) -> None:
            reply_json(self, status, body)

        def do_GET(self) -> None:  # noqa: N802
            url = urlparse(self.path)
            fake.calls.append(("GET", url.path))
            if url.path == "/api/v1/alerts":
                firing = fake.firing if len(fake.patches()) >= fake.firing_after_patches else []
                alerts = [{"labels": {"alertname": n}, "state": "firing", "annotations": {"summary": "test"}}
                          for n in firing]
                return self._reply(200, {"status": "success", "data": {"alerts": alerts}})
            if url.path in fake.objects:
                return self._reply(200, fake.objects[url.path])
            if url.path == "/api/v1/namespaces/specdeploy/pods":
                selector = parse_qs(url.query)["labelSelector"][0]
                assert "specdeploy.dev/slot=green" in selector and "app.kubernetes.io/component=server" in selector
                pods = [{"metadata": {"name": f"specdeploy-green-{i}"}, "status": {"phase": "Running"}}
                        for i in range(2)]
                return self._reply(200, {"kind": "PodList", "items": pods})
            if url.path.endswith(":8000/proxy/metrics") and fake.pod_metrics is not None:
                fake.pod_metrics.serve(5)
                body = fake.pod_metrics.metrics().encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return None
            if url.path.endswith(("/ingresses", "/httproutes")):
                wanted = dict(s.split("=") for s in parse_qs(url.query)["labelSelector"][0].split(","))
                items = [o for p, o in fake.objects.items() if p.startswith(url.path + "/")
                         and wanted.items() <= o["metadata"].get("labels", {}).items()]
                return self._reply(200, {"kind": "List", "items": items})
            return self._reply(404, {"kind": "Status", "reason": "NotFound"})

        def do_PATCH(self) -> None:  # noqa: N802
            fake.calls.append(("PATCH", self.path))
            assert self.headers["Content-Type"] == "application/merge-patch+json"
            assert self.headers["Authorization"] == "Bearer test-token"
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            current = fake.objects[self.path]["metadata"]["resourceVersion"]
            if body.get("metadata", {}).get("resourceVersion", current) != current:
                return self._reply(409, {"kind": "Status", "reason": "Conflict"})
            fake.objects[self.path] = merge_patch(fake.objects[self.path], body)
            fake.objects[self.path]["metadata"]["resourceVersion"] = str(int(current) + 1)
            return self._reply(200, fake.objects[self.path])

        def _body(self) -> dict[str, Any]:
            return dict(json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}"))

        def do_POST(self) -> None:  # noqa: N802 (create: 409 AlreadyExists when the name is taken)
            fake.calls.append(("POST", self.path))
            body = self._body()
            path = f"{self.path}/{body['metadata']['name']}"
            with fake.mutex:
                if path in fake.objects:
                    return self._reply(409, {"kind": "Status", "reason": "AlreadyExists"})
                body["metadata"]["resourceVersion"] = "1"
                fake.objects[path] = body
            return self._reply(201, body)

        def do_PUT(self) -> None:  # noqa: N802 (replace: 409 Conflict unless resourceVersion is the current one)
            fake.calls.append(("PUT", self.path))
            body = self._body()
            with fake.mutex:
                if self.path not in fake.objects:
                    return self._reply(404, {"kind": "Status", "reason": "NotFound"})
                current = fake.objects[self.path]["metadata"]["resourceVersion"]
                if body.get("metadata", {}).get("resourceVersion") != current:
                    return self._reply(409, {"kind": "Status", "reason": "Conflict"})
                body["metadata"]["resourceVersion"] = str(int(current) + 1)
                fake.objects[self.path] = body
            return self._reply(200, body)

        def do_DELETE(self) -> None:  # noqa: N802 (preconditions.resourceVersion as the API server checks it)
            fake.calls.append(("DELETE", self.path))
            wanted = self._body().get("preconditions", {}).get("resourceVersion")
            with fake.mutex:
                if self.path not in fake.objects:
                    return self._reply(404, {"kind": "Status", "reason": "NotFound"})
                if wanted is not None and wanted != fake.objects[self.path]["metadata"]["resourceVersion"]:
                    return self._reply(409, {"kind": "Status", "reason": "Conflict"})
                del fake.objects[self.path]
            return self._reply(200, {"kind": "Status", "status": "Success"})

        def log_message(self, *args: Any) -> None:
            pass

    with loopback_http(Handler) as url:
        fake.url = url
        yield fake


def k8s(command: str, stacks: Path, kubeconfig: Path, *extra: str) -> int:
    return main([command, "--stack", "k8s-prod", "--stacks-dir", str(stacks), "--state-dir",
                 str(stacks.parent / "state"), "--kubeconfig", str(kubeconfig), *extra])


def test_rollout_shifts_the_canary_weight_and_updates_the_stack_file(
        api_server: FakeApiServer, kubeconfig: Path, prod_copy: Path, slot_server: SlotServer) -> None:
    assert k8s("rollout", prod_copy, kubeconfig, "--to", "green", "--steps", "50,100",
               "--slot-endpoint", slot_server.url, "--prometheus-url", api_server.url, *FAST) == 0
    assert canary_weights(api_server.canary()) == {"green": 100, "blue": 0}
    assert len(api_server.patches()) == 2
    # paging followed each shift without a `pulumi up`: the alerts now watch green only
    assert len(api_server.traffic_patches()) == 2 and api_server.traffic() == {"green": 100, "blue": 0}
    release = load_stack("k8s-prod", prod_copy).config.slots
    assert (release.active, release.canary_weight) == ("green", 0)


def test_firing_prometheus_alert_rolls_the_canary_back(
        api_server: FakeApiServer, kubeconfig: Path, prod_copy: Path, slot_server: SlotServer,
        capsys: pytest.CaptureFixture[str]) -> None:
    api_server.firing, api_server.firing_after_patches = ["SpecdeployHighP99Ttft"], 1
    assert k8s("rollout", prod_copy, kubeconfig, "--to", "green", "--slot-endpoint", slot_server.url,
               "--prometheus-url", api_server.url, *FAST) == 1
    assert "alarm SpecdeployHighP99Ttft is ALARM" in capsys.readouterr().out
    assert canary_weights(api_server.canary()) == {"green": 0, "blue": 100}
    release = load_stack("k8s-prod", prod_copy).config.slots
    assert (release.active, release.canary_weight) == ("blue", 0)


def test_rollback_is_one_patch_of_the_canary_ingress(api_server: FakeApiServer, kubeconfig: Path,
                                                     prod_copy: Path) -> None:
    assert k8s("rollback", prod_copy, kubeconfig) == 0
    assert api_server.patches() == ["/apis/networking.k8s.io/v1/namespaces/specdeploy/ingresses/specdeploy-canary"]
    assert canary_weights(api_server.canary()) == {"green": 0, "blue": 100}
    assert api_server.traffic() == {"green": 0, "blue": 100}  # green's alerts stop paging at once
    release = load_stack("k8s-prod", prod_copy).config.slots
    assert (release.active, release.canary_weight) == ("blue", 10)  # recording is a separate step
    assert main(["release", "record", "--stack", "k8s-prod", "--stacks-dir", str(prod_copy), "--state-dir",
                 str(prod_copy.parent / "state"), "--kubeconfig", str(kubeconfig)]) == 0
    release = load_stack("k8s-prod", prod_copy).config.slots
    assert (release.active, release.canary_weight) == ("blue", 0)  # the committed 10 % canary is gone


def test_the_rendered_role_admits_every_request_of_a_release_and_nothing_more(
        api_server: FakeApiServer, kubeconfig: Path, prod_copy: Path, slot_server: SlotServer,
        rendered: list[dict[str, Any]]) -> None:
    """The Role the stack renders for `specdeploy-release` against every request a rollout (gated on the
    pods' metrics through the API proxy and on Prometheus), a rollback, a record and an unlock send."""
    role = next(o for o in rendered if o["kind"] == "Role" and o["metadata"]["name"] == "specdeploy-release")
    binding = next(o for o in rendered if o["kind"] == "RoleBinding" and o["metadata"]["name"] == "specdeploy-release")
    assert binding["roleRef"]["name"] == "specdeploy-release"
    assert binding["subjects"] == [{"kind": "Group", "apiGroup": "rbac.authorization.k8s.io",
                                    "name": "specdeploy-release"}]
    api_server.pod_metrics = slot_server  # no --slot-endpoint: the metrics gate goes through the API proxy
    # a lock left by a crashed release, expired: the rollout takes it over (a Lease update, as renewals are)
    from dataclasses import replace

    from infra.ops.release.kubernetes import KubeApi
    from infra.ops.release.lock import KubeLease, SharedLock, me

    crashed = replace(me("specdeploy rollout --stack k8s-prod --to green"), holder="alice@laptop", pid=4242,
                      renewed_at=0.0)
    SharedLock(KubeLease(KubeApi.from_environment(kubeconfig, None), "specdeploy"), crashed,
               lambda *a, **k: None).acquire()
    assert k8s("rollout", prod_copy, kubeconfig, "--to", "green", "--steps", "50,100",
               "--prometheus-url", api_server.url, *FAST) == 0
    assert k8s("rollback", prod_copy, kubeconfig) == 0
    assert main(["release", "record", "--stack", "k8s-prod", "--stacks-dir", str(prod_copy), "--state-dir",
                 str(prod_copy.parent / "state"), "--kubeconfig", str(kubeconfig)]) == 0
    assert k8s("unlock", prod_copy, kubeconfig) == 0
    assert any("/proxy" in path for _, path in api_server.calls)
    denied, unused = rbac_check(api_server.calls, role)
    assert denied == []
    assert unused == []
    # the PrometheusRule grant is limited to the traffic record by name: the same patch of any other rule,
    # e.g. the alerts the stack owns, is refused
    traffic = "/apis/monitoring.coreos.com/v1/namespaces/specdeploy/prometheusrules/specdeploy-traffic"
    assert ("PATCH", traffic) in api_server.calls
    other = traffic.replace("specdeploy-traffic", "specdeploy-alerts")
    assert rbac_check([("PATCH", other)], role)[0] == [
        "patch monitoring.coreos.com/prometheusrules/specdeploy-alerts in specdeploy"]


def test_unready_deployment_is_refused(api_server: FakeApiServer, kubeconfig: Path, prod_copy: Path,
                                       slot_server: SlotServer, capsys: pytest.CaptureFixture[str]) -> None:
    api_server.objects["/apis/apps/v1/namespaces/specdeploy/deployments/specdeploy-green"]["status"] = {}
    assert k8s("rollout", prod_copy, kubeconfig, "--to", "green", "--slot-endpoint", slot_server.url, *FAST) == 1
    assert api_server.patches() == []
    assert "green is not ready: deployment specdeploy-green: 0/" in capsys.readouterr().out


def test_without_an_endpoint_the_pods_metrics_are_read_through_the_api_proxy(
        api_server: FakeApiServer, kubeconfig: Path, prod_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pods = api_server.pod_metrics = SlotServer()
    original = pods.metrics

    def failing_after_first_shift() -> str:
        if api_server.patches():
            pods.error_requests += 20
        return original()

    pods.metrics = failing_after_first_shift  # type: ignore[method-assign]
    assert k8s("rollout", prod_copy, kubeconfig, "--to", "green", *FAST) == 1
    assert "green error rate" in capsys.readouterr().out
    proxied = [path for method, path in api_server.calls if path.endswith("/proxy/metrics")]
    assert {p.split("/pods/")[1] for p in proxied} == {"specdeploy-green-0:8000/proxy/metrics",
                                                       "specdeploy-green-1:8000/proxy/metrics"}
    assert canary_weights(api_server.canary()) == {"green": 0, "blue": 100}


def test_rollback_refuses_a_slot_with_nothing_ready(api_server: FakeApiServer, kubeconfig: Path, prod_copy: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    api_server.objects["/apis/apps/v1/namespaces/specdeploy/deployments/specdeploy-blue"]["status"] = {}
    assert k8s("rollback", prod_copy, kubeconfig) == 2
    assert "blue has nothing ready" in capsys.readouterr().err
    assert api_server.patches() == []
    assert k8s("rollback", prod_copy, kubeconfig, "--force") == 0
    assert canary_weights(api_server.canary()) == {"green": 0, "blue": 100}
