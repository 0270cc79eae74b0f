"""Issue 13 item 1: the slot path `specdeploy rollout` validates and guards on is one the rendered network rules admit.

The destination comes from the CLI's own code path (``wiring.connect`` with the stack's outputs as
`pulumi stack output` would give them); the source is an address the release tooling runs from
(``release.gate_cidrs``). Both are checked against the rendered security groups, listeners
and listener rules of the same program: operator → ALB slot listener → that slot's target
group → the slot's instances, which admit the server port from the load balancer only.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pulumi
import pytest

from infra.config import load_stack
from infra.ops.cli import release_cmd
from infra.ops.cli.main import build_parser
from infra.ops.release import targets, wiring
from infra.program.preview import PreviewResult, RecordedResource

SG = "aws:ec2/securityGroup:SecurityGroup"
LISTENER = "aws:lb/listener:Listener"
RULE = "aws:lb/listenerRule:ListenerRule"
INGRESS = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
EGRESS = "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule"
OUTSIDER = "192.0.2.10"  # TEST-NET-1: in no stack's allow-list


def _cli_slot_path(result: PreviewResult, slot: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The endpoints `specdeploy rollout --to <slot>` validates and gates on, given the stack's outputs."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    for slot_name in ("BLUE", "GREEN"):
        monkeypatch.delenv(f"SPECDEPLOY_{slot_name}_ENDPOINT", raising=False)
    monkeypatch.setattr(targets, "stack_outputs", lambda stack: result.exports)
    stacks = tmp_path / "stacks"
    stacks.mkdir(exist_ok=True)
    (stacks / f"Pulumi.{result.stack}.yaml").write_text(result.config_text)  # type: ignore[attr-defined]
    args = build_parser().parse_args(["rollout", "--stack", result.stack, "--to", slot, "--stacks-dir", str(stacks),
                                      "--state-dir", str(tmp_path / "state")])
    release, _, endpoints = wiring.connect(release_cmd._session(args), slot=slot, with_alarms=False)
    # What the rollout falls back to when no endpoint was given: the router's idea of the slot.
    assert release.router.slot_endpoints.get(slot) in endpoints
    return endpoints


def _admits(cidrs: list[str], source: str) -> bool:
    return any(ipaddress.ip_address(source) in ipaddress.ip_network(c) for c in cidrs)


def _check_path(result: PreviewResult, slot: str, endpoint: str, source: str) -> None:
    config = result.config
    url = urlsplit(endpoint)
    alb = result.single("aws:lb/loadBalancer:LoadBalancer")
    assert url.hostname in {alb.outputs["dnsName"], config.access.domain}, url.hostname
    listeners = [r for r in result.of_type(LISTENER)
                 if r.inputs["loadBalancerArn"] == alb.outputs["arn"] and int(r.inputs["port"]) == url.port]
    assert len(listeners) == 1, f"no listener on port {url.port}"
    listener = listeners[0]
    assert listener.inputs["protocol"] == url.scheme.upper()
    # The ALB's security group admits the source on that port.
    lb_sg = result.one(SG, "lb-sg")
    assert any(int(i["fromPort"]) <= url.port <= int(i["toPort"]) and _admits(i["cidrBlocks"], source)
               for i in lb_sg.inputs["ingress"]), f"{source} not admitted on {url.port}"
    # A rule of that listener matching the source forwards to the slot's target group, and only there.
    tg_arn = result.exports["target_group_arns"][slot]
    rules = [r for r in result.of_type(RULE) if r.inputs["listenerArn"] == listener.outputs["arn"]]
    matching = [r for r in rules if _rule_matches(r, source)]
    assert matching and all(a.get("targetGroupArn") == tg_arn for r in matching for a in r.inputs["actions"])
    assert not any(_rule_matches(r, OUTSIDER) for r in rules)
    assert all(a["type"] != "forward" for a in listener.inputs["defaultActions"])  # everyone else: 403
    # The target group reaches the slot's servers, whose security group admits the load balancer.
    group = result.one("aws:lb/targetGroup:TargetGroup", f"lb-{slot}")
    port = config.service.port
    assert int(group.inputs["port"]) == port
    fleet_sg = result.one(SG, f"fleet-{slot}-sg").outputs["id"]
    assert any(r.inputs["securityGroupId"] == fleet_sg and r.inputs["referencedSecurityGroupId"] == lb_sg.outputs["id"]
               and int(r.inputs["fromPort"]) == port for r in result.of_type(INGRESS))
    assert any(r.inputs["securityGroupId"] == lb_sg.outputs["id"] and r.inputs["referencedSecurityGroupId"] == fleet_sg
               and int(r.inputs["fromPort"]) == port for r in result.of_type(EGRESS))
    # And nothing else reaches the servers: no CIDR-based ingress on the fleet (the old private-IP probe).
    assert not any(r.inputs["securityGroupId"] == fleet_sg and r.inputs.get("cidrIpv4")
                   for r in result.of_type(INGRESS))


def _rule_matches(rule: RecordedResource, source: str) -> bool:
    conditions: list[dict[str, Any]] = rule.inputs["conditions"]
    return all(_admits(c["sourceIp"]["values"], source) for c in conditions if "sourceIp" in c) and \
        any("sourceIp" in c for c in conditions)


def _with_config_text(result: PreviewResult, stacks_dir: Path | None) -> PreviewResult:
    from infra.config import project_stacks_dir

    path = (stacks_dir or project_stacks_dir()) / f"Pulumi.{result.stack}.yaml"
    result.config_text = path.read_text()  # type: ignore[attr-defined]
    return result


def _source(result: PreviewResult) -> str:
    """An address of the operators' network: the first host of the first gate CIDR the stack renders."""
    from infra.program.aws_args import slot_listener_cidrs

    return str(next(ipaddress.ip_network(slot_listener_cidrs(result.config)[0]).hosts()))


@pytest.mark.parametrize("stack", ["dev", "staging", "prod"])
@pulumi.runtime.test
def test_the_cli_reaches_the_slot_through_a_path_the_rendered_rules_admit(
        stack: str, aws_stack: Callable[[str], PreviewResult], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    result = _with_config_text(aws_stack(stack), None)
    slot = result.config.slots.active  # the slot with a fleet in the committed stack
    endpoints = _cli_slot_path(result, slot, tmp_path, monkeypatch)
    assert len(endpoints) == 1
    _check_path(result, slot, endpoints[0], _source(result))


@pulumi.runtime.test
def test_the_idle_slot_is_reachable_alone_through_its_own_listener(
        aws_variant: Callable[..., PreviewResult], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = load_stack("prod").config.slots.model_dump(mode="json", exclude_none=True)
    variant_dir = tmp_path / "variant"
    variant_dir.mkdir()
    result = aws_variant("prod", release={**release, "green": release["blue"]})
    result = _with_config_text(result, tmp_path)
    endpoints = _cli_slot_path(result, "green", variant_dir, monkeypatch)
    assert endpoints == [f"https://{result.config.access.domain}:8082"]
    _check_path(result, "green", endpoints[0], _source(result))
    blue = _cli_slot_path(result, "blue", variant_dir, monkeypatch)
    assert blue != endpoints  # each slot alone, never the weighted listener


@pulumi.runtime.test
def test_a_public_stack_without_gate_cidrs_opens_no_slot_listener(aws_variant: Callable[..., PreviewResult]) -> None:
    release = load_stack("prod").config.slots.model_dump(mode="json", exclude_none=True)
    result = aws_variant("prod", release={**release, "gate_cidrs": None})
    assert result.exports["gate_endpoints"] == {}
    assert not [r for r in result.of_type(LISTENER) if int(r.inputs["port"]) in (8081, 8082)]


def test_world_open_gate_cidrs_are_refused() -> None:
    from infra.config import ReleaseSpec

    with pytest.raises(ValueError, match="opens each slot's direct path to the world"):
        ReleaseSpec.model_validate({"blue": {"image": "x", "model_version": "s3://b/m"},
                                    "gate_cidrs": ["0.0.0.0/0"]})
