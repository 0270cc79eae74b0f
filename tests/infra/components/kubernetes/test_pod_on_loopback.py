"""The pod, run on loopback: the rendered init command pulls, the rendered config serves.

A k8s-dev variant points at a tiny random model in a file:// store. The test runs the
Deployment's init container command and then the server container command with the
ConfigMap's server.yaml (cluster paths mapped into a temporary directory, the Secret's
api-keys file written there), probes the endpoints the Deployment probes, sends a request
and reads /metrics: every series the PrometheusRule and the dashboard query must be on the
page (GPU gauges exist only on CUDA; they are checked on the server's metric registry).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from infra.config import load_stack
from serving import metric_names
from serving.net import NotReady, free_port, wait_until_ready

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[4]
KEY = "k8s-live-test-key-0123456789"
GPU_ONLY = {metric_names.GPU_MEMORY_USED, metric_names.GPU_MEMORY_TOTAL, metric_names.GPU_UTILIZATION}


def _in_image(command: list[str]) -> list[str]:
    """A container command as this machine runs it: the image's python3 is this interpreter."""
    assert command[:2] == ["python3", "-m"], command
    return [sys.executable, *command[1:]]


class Pod:
    """The rendered Deployment and ConfigMap of slot blue, with cluster paths mapped under `root`."""

    def __init__(self, objects: list[dict[str, Any]], root: Path) -> None:
        self.deployment = next(o for o in objects if o["kind"] == "Deployment")
        self.config_map = next(o for o in objects if o["kind"] == "ConfigMap" and "server.yaml" in o.get("data", {}))
        self.pod_spec = self.deployment["spec"]["template"]["spec"]
        self.server = next(c for c in self.pod_spec["containers"] if c["name"] == "server")
        self.root = root

    def local(self, cluster_path: str) -> str:
        return str(self.root / cluster_path.lstrip("/"))

    def probe_path(self, probe: str) -> str:
        return str(self.server[probe]["httpGet"]["path"])


@pytest.fixture(scope="module")
def pod(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory, render: Any,
        variant_config: Any) -> Pod:
    from serving.weights import push

    store = tmp_path_factory.mktemp("store")
    uri = f"file://{store}/tiny/v1"
    push(tiny_chat_model, uri)
    config = variant_config(
        "k8s-dev",
        model={"source": uri, "dtype": "fp32", "params_b": None},
        draft=None,
        speculative={"enabled": True, "method": "ngram"},
        scheduler={"max_concurrency": 4, "max_input_len": 512, "max_output_len": 256, "max_queue": 8,
                   "max_batched_tokens": 512},
        service={"drain_grace_s": 5},
        release={"active": "blue", "blue": {"image": "specdeploy-server:test", "model_version": uri}},
    )
    return Pod(render("k8s-dev", config).manifests, tmp_path_factory.mktemp("pod"))


@pytest.fixture(scope="module")
def served(pod: Pod) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    # 1. The init container, as rendered.
    [init] = pod.pod_spec["initContainers"]
    command = init["command"]
    assert command[:4] == ["python3", "-m", "serving.weights", "pull"]
    subprocess.run(_in_image([*command[:-1], pod.local(command[-1])]), cwd=REPO, check=True, timeout=120)

    # 2. The mounted files: ConfigMap (cluster paths mapped under the pod root, loopback port) and api-keys.
    port = free_port()
    server_yaml = pod.config_map["data"]["server.yaml"]
    settings = yaml.safe_load(server_yaml)
    keys = Path(pod.local(settings["service"]["api_keys_file"]))
    settings["service"].update(host="127.0.0.1", port=port, api_keys_file=str(keys))
    settings["model"]["path"] = pod.local(settings["model"]["path"])
    config_path = Path(pod.local(pod.server["command"][-1]))
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(settings))
    keys.parent.mkdir(parents=True, exist_ok=True)
    keys.write_text(f"k8s:{KEY}\n")

    # 3. The server container, as rendered (CPU: device and KV budget from environment overrides).
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEPLOY")}
    env.update(SPECDEPLOY__MODEL__DEVICE="cpu", SPECDEPLOY__MODEL__KV_CACHE_BYTES=str(4 * 2**20))
    command = pod.server["command"]
    assert command[:3] == ["python3", "-m", "serving"]
    log = (pod.root / "server.log").open("wb")
    proc = subprocess.Popen(_in_image([*command[:-1], str(config_path)]), cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_ready(base, 180, proc, path=pod.probe_path("startupProbe"))
        except NotReady as exc:
            pytest.fail(f"{exc}\n" + (pod.root / "server.log").read_text())
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


@pytest.fixture(scope="module")
def metrics_page(served: tuple[str, subprocess.Popen[bytes]]) -> set[str]:
    base, _ = served
    response = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                          json={"model": "qwen2.5-7b-instruct", "prompt": "one two one two one", "max_tokens": 8})
    assert response.status_code == 200, response.text
    page = httpx.get(f"{base}/metrics", timeout=10).text
    return {line.split("{")[0].split(" ")[0] for line in page.splitlines() if line and not line.startswith("#")}


def test_probe_endpoints_answer(served: tuple[str, subprocess.Popen[bytes]], pod: Pod) -> None:
    base, _ = served
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert httpx.get(base + pod.probe_path(probe), timeout=5).status_code == 200, probe


def test_rendered_api_key_file_authenticates(served: tuple[str, subprocess.Popen[bytes]]) -> None:
    base, _ = served
    assert httpx.get(f"{base}/v1/models", timeout=5).status_code == 401
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).status_code == 200


def test_every_queried_series_is_on_the_metrics_page(metrics_page: set[str], queried: Any) -> None:
    wanted = queried(load_stack("k8s-prod").config) - GPU_ONLY
    assert wanted, "nothing queried"
    assert wanted <= metrics_page, f"queried but not exported: {sorted(wanted - metrics_page)}"


def test_every_gpu_series_queried_is_registered_on_cuda(queried: Any) -> None:
    from prometheus_client import generate_latest

    from serving.api.metrics import ServerMetrics

    metrics = ServerMetrics(speculative=True)
    metrics.enable_gpu()  # what the server does when its engine runs on CUDA
    page = generate_latest(metrics.registry).decode()
    registered = {line.split("{")[0].split(" ")[0] for line in page.splitlines() if line and line[0] != "#"}
    gpu_queried = queried(load_stack("k8s-prod").config) & GPU_ONLY
    assert gpu_queried, "no GPU series queried"
    assert gpu_queried <= registered, f"queried but not registered on CUDA: {sorted(gpu_queried - registered)}"


def test_server_drains_and_exits_zero_within_the_grace_period(served: tuple[str, subprocess.Popen[bytes]],
                                                               pod: Pod) -> None:
    _, proc = served
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=pod.pod_spec["terminationGracePeriodSeconds"]) == 0
