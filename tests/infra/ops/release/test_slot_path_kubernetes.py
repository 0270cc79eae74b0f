"""Issue 13 item 1 on Kubernetes: the rollout's gates reach the new slot by a path the rendered
NetworkPolicy admits. With ``release.gate_cidrs`` the policy admits those networks to the server
port, and the CLI gates on the slot's pod addresses instead of the API server's pod proxy (which the
policy does not admit). Source: an address of the gate networks; destination: what ``wiring.connect``
returns; both checked against the NetworkPolicy and the Deployment rendered from the same stack file.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pulumi
import pytest

from infra.ops.cli import release_cmd
from infra.ops.cli.main import build_parser
from infra.ops.k8s_render import render_objects
from infra.ops.release import kubernetes, targets, wiring
from infra.program.preview import PreviewResult
from tests.infra.conftest import write_variant

GATES = ["10.20.0.0/16"]
OPERATOR = "10.20.3.4"  # a pipeline runner in the gate network
OUTSIDER = "192.0.2.10"
POD_IPS = {"blue": "10.1.0.11", "green": "10.1.0.12"}


class StubApi:
    """The API server as far as `_connect` reads it: the slots' pods with their addresses."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.server = "https://stub"

    def get(self, path: str, **query: str) -> dict[str, Any]:
        if path != f"/api/v1/namespaces/{self.namespace}/pods":
            return {"items": []}
        slot = dict(part.split("=", 1) for part in query["labelSelector"].split(","))["specdeploy.dev/slot"]
        ready, loading = [{"type": "Ready", "status": "True"}], [{"type": "Ready", "status": "False"}]
        return {"items": [
            {"metadata": {"name": f"specdeploy-{slot}-0"},
             "status": {"phase": "Running", "podIP": POD_IPS[slot], "conditions": ready}},
            {"metadata": {"name": f"specdeploy-{slot}-1"},  # still loading weights: not a gate target
             "status": {"phase": "Running", "podIP": "10.1.0.99", "conditions": loading}},
        ]}


def _slot_path_endpoints(stacks: Path, slot: str, namespace: str, tmp_path: Path,
                    monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setattr(targets, "stack_outputs", lambda stack: {})
    monkeypatch.setattr(kubernetes.KubeApi, "from_environment", lambda *a, **k: StubApi(namespace))
    for name in ("SPECDEPLOY_BLUE_ENDPOINT", "SPECDEPLOY_GREEN_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    args = build_parser().parse_args(["rollout", "--stack", "k8s-prod", "--to", slot, "--stacks-dir", str(stacks),
                                      "--state-dir", str(tmp_path / "state")])
    _, _, endpoints = wiring.connect(release_cmd._session(args), slot=slot, with_alarms=False)
    return endpoints


def _admitted(policy: dict[str, Any], source: str, port: int) -> bool:
    for rule in policy["spec"]["ingress"]:
        ports = {int(p["port"]) for p in rule.get("ports", [])}
        blocks = [peer["ipBlock"]["cidr"] for peer in rule.get("from", []) if "ipBlock" in peer]
        if port in ports and any(ipaddress.ip_address(source) in ipaddress.ip_network(b) for b in blocks):
            return True
    return False


@pulumi.runtime.test
def test_the_slot_path_uses_pod_addresses_the_network_policy_admits_from_the_gate_networks(
        aws_variant: Callable[..., PreviewResult], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from infra.config import load_stack

    release = load_stack("k8s-prod").config.slots.model_dump(mode="json", exclude_none=True)
    stacks = write_variant(tmp_path, "k8s-prod", release={**release, "gate_cidrs": GATES})
    result = aws_variant("k8s-prod", release={**release, "gate_cidrs": GATES})
    objects = render_objects((r.type, r.inputs) for r in result.resources)
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    port = result.config.service.port
    namespace = policy["metadata"]["namespace"]
    for slot in [s for s in ("blue", "green") if result.config.slots.slot(s) is not None]:
        endpoints = _slot_path_endpoints(stacks, slot, namespace, tmp_path, monkeypatch)
        assert endpoints == [f"http://{POD_IPS[slot]}:{port}"]  # ready pods only, never /proxy
        (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] ==
                         f"specdeploy-{slot}"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        assert _admitted(policy, OPERATOR, port)
        assert not _admitted(policy, OUTSIDER, port)


@pulumi.runtime.test
def test_without_gate_networks_the_policy_admits_only_the_namespaces(
        aws_stack: Callable[[str], PreviewResult]) -> None:
    objects = render_objects((r.type, r.inputs) for r in aws_stack("k8s-prod").resources)
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    assert all("namespaceSelector" in peer for rule in policy["spec"]["ingress"] for peer in rule["from"])
