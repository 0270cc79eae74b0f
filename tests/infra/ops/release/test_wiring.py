"""The release wiring: where the shift guard reads the new slot's metrics (error rate, P99)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from infra.config import StackFile, load_stack
from infra.ops.release.kubernetes import IngressCanaryRouter
from infra.ops.release.state import StepLog
from infra.ops.release.wiring import Session, slot_metrics


class PodListing:
    """The API server answering the pod list of a namespace: one running pod, one pending."""

    def get(self, path: str, **params: str) -> dict[str, Any]:
        return {"items": [{"metadata": {"name": "specdeploy-green-1"}, "status": {"phase": "Running"}},
                          {"metadata": {"name": "specdeploy-green-2"}, "status": {"phase": "Pending"}}]}

    def get_text(self, path: str) -> str:
        return ""


def _release(router: Any, tmp_path: Path) -> Any:
    return SimpleNamespace(router=router, log=StepLog(tmp_path / "log.jsonl", "k8s-dev"))


def _session(stack: StackFile, tmp_path: Path, said: list[str] | None = None) -> Session:
    return Session(stack, None, tmp_path, None, (said if said is not None else []).append)  # type: ignore[arg-type]


def _events(release: Any) -> list[str]:
    return [record["event"] for record in release.log.read()]


@pytest.fixture
def k8s_stack() -> StackFile:
    return load_stack("k8s-dev")


def test_given_endpoints_are_scraped_directly(k8s_stack: StackFile, tmp_path: Path) -> None:
    release = _release(object(), tmp_path)
    metrics = slot_metrics(_session(k8s_stack, tmp_path), release, "green", ["http://10.0.0.7:8000/"])
    assert metrics is not None and metrics.endpoints == ["http://10.0.0.7:8000"]
    assert _events(release) == []


def test_kubernetes_without_endpoints_reads_running_pods_through_the_api_proxy(k8s_stack: StackFile,
                                                                               tmp_path: Path) -> None:
    release = _release(IngressCanaryRouter(PodListing(), "specdeploy"), tmp_path)  # type: ignore[arg-type]
    metrics = slot_metrics(_session(k8s_stack, tmp_path), release, "green", [])
    port = k8s_stack.config.service.port
    assert metrics is not None
    assert metrics.endpoints == [f"/api/v1/namespaces/specdeploy/pods/specdeploy-green-1:{port}/proxy"]
    assert _events(release) == ["metrics_via_api_proxy"]


def test_without_any_way_to_the_slot_the_metrics_check_is_off(k8s_stack: StackFile, tmp_path: Path) -> None:
    release = _release(object(), tmp_path)
    said: list[str] = []
    assert slot_metrics(_session(k8s_stack, tmp_path, said), release, "green", []) is None
    assert _events(release) == ["metrics_check_off"]
    assert any("error-rate/P99 check off" in line for line in said)
