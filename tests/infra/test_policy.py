"""The policy pack: every AWS stack passes, and each policy catches its violating case."""

from __future__ import annotations

import ast
import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pulumi
import pytest

from infra.components.aws.user_data import decode_user_data, encode_user_data
from infra.policy.aws_policies import POLICIES
from infra.policy.offline import Violation, check, props_of, run_policy
from infra.program.preview import PreviewResult

StackFn = Callable[[str], PreviewResult]
POLICY = {policy.name: policy for policy in POLICIES}


def _violations(result: PreviewResult, policy: str, name: str, change: Callable[[dict[str, Any]], None]) -> list[
        Violation]:
    """Run one policy over the stack with resource `name`'s properties changed by `change`."""
    resource = next(r for r in result.resources if r.name == name)
    props = copy.deepcopy(props_of(resource))
    change(props)
    return run_policy(POLICY[policy], result.resources, {name: props})


@pytest.mark.parametrize("stack", ["dev", "staging", "prod"])
@pulumi.runtime.test
def test_every_aws_stack_passes_the_pack(stack: str, aws_stack: StackFn) -> None:
    assert check(aws_stack(stack).resources) == []


def test_pack_has_the_rules_of_the_issues() -> None:
    assert set(POLICY) == {"s3-buckets-private-encrypted-versioned", "no-world-open-server-port",
                           "internal-paths-not-public",
                           "tls-on-public-listeners", "imdsv2-required", "alarms-have-runbook-and-action",
                           "instances-not-public", "no-plaintext-secret-in-user-data"}


def test_pack_entry_point_only_constructs_the_pack() -> None:
    tree = ast.parse((Path(__file__).resolve().parents[2] / "infra" / "policy" / "__main__.py").read_text())
    calls = [node for node in tree.body if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)]
    assert len(calls) == 1 and ast.unparse(calls[0]).startswith("PolicyPack(")


@pulumi.runtime.test
def test_public_bucket_is_caught(aws_stack: StackFn) -> None:
    found = _violations(aws_stack("dev"), "s3-buckets-private-encrypted-versioned", "models-bucket-public-access",
                        lambda p: p.update(blockPublicPolicy=False))
    assert [v.message for v in found] == ["bucket acme-specdeploy-models-dev: no public access block with all "
                                          "four settings on"]


@pulumi.runtime.test
def test_unversioned_bucket_is_caught(aws_stack: StackFn) -> None:
    found = _violations(aws_stack("dev"), "s3-buckets-private-encrypted-versioned", "lb-logs-versioning",
                        lambda p: p.update(versioningConfiguration={"status": "Suspended"}))
    assert [v.message for v in found] == ["bucket lb-logs: versioning is not enabled"]


@pulumi.runtime.test
def test_unencrypted_bucket_is_caught(aws_stack: StackFn) -> None:
    found = _violations(aws_stack("dev"), "s3-buckets-private-encrypted-versioned", "models-bucket-encryption",
                        lambda p: p.update(bucket="some-other-bucket"))
    assert [v.message for v in found] == ["bucket acme-specdeploy-models-dev: no default encryption"]


@pulumi.runtime.test
def test_world_open_server_port_rule_is_caught(aws_stack: StackFn) -> None:
    def open_to_world(props: dict[str, Any]) -> None:
        props.pop("referencedSecurityGroupId")
        props["cidrIpv4"] = "0.0.0.0/0"

    found = _violations(aws_stack("prod"), "no-world-open-server-port", "fleet-blue-from-lb", open_to_world)
    assert len(found) == 1 and "ports 8000-8000" in found[0].message


@pulumi.runtime.test
def test_world_open_server_port_in_a_security_group_is_caught(aws_stack: StackFn) -> None:
    def open_port(props: dict[str, Any]) -> None:
        props["ingress"] = [{"protocol": "tcp", "fromPort": 8000, "toPort": 8000, "cidrBlocks": ["0.0.0.0/0"]}]

    assert _violations(aws_stack("prod"), "no-world-open-server-port", "fleet-blue-sg", open_port)


@pulumi.runtime.test
def test_world_open_https_on_the_load_balancer_is_allowed(aws_stack: StackFn) -> None:
    assert run_policy(POLICY["no-world-open-server-port"], aws_stack("prod").resources) == []


@pulumi.runtime.test
def test_public_plain_http_listener_is_caught(aws_stack: StackFn) -> None:
    def forward(props: dict[str, Any]) -> None:
        props["defaultActions"] = [{"type": "forward", "targetGroupArn": "arn:tg"}]

    found = _violations(aws_stack("prod"), "tls-on-public-listeners", "lb-http-redirect", forward)
    assert len(found) == 1 and "serves traffic without TLS" in found[0].message


@pulumi.runtime.test
def test_https_listener_without_tls_policy_is_caught(aws_stack: StackFn) -> None:
    found = _violations(aws_stack("prod"), "tls-on-public-listeners", "lb-https", lambda p: p.pop("sslPolicy"))
    assert len(found) == 1 and "without certificate or TLS policy" in found[0].message


@pulumi.runtime.test
def test_internal_plain_http_listener_is_allowed(aws_stack: StackFn) -> None:
    assert run_policy(POLICY["tls-on-public-listeners"], aws_stack("dev").resources) == []


@pulumi.runtime.test
def test_imds_v1_is_caught(aws_stack: StackFn) -> None:
    found = _violations(aws_stack("dev"), "imdsv2-required", "fleet-blue-lt",
                        lambda p: p["metadataOptions"].update(httpTokens="optional"))
    assert [v.message for v in found] == ["fleet-blue-lt: metadataOptions.httpTokens must be 'required' (IMDSv2 only)"]


@pulumi.runtime.test
def test_alarm_without_action_is_caught(aws_stack: StackFn) -> None:
    found = _violations(aws_stack("dev"), "alarms-have-runbook-and-action", "alerts-blue-SpecdeployHighErrorRate",
                        lambda p: p.update(alarmActions=[]))
    assert [v.message for v in found] == ["alerts-blue-SpecdeployHighErrorRate: alarm has no alarmActions; nobody "
                                          "would be told"]


@pulumi.runtime.test
def test_alarm_without_runbook_is_caught(aws_stack: StackFn) -> None:
    found = _violations(aws_stack("dev"), "alarms-have-runbook-and-action", "alerts-blue-SpecdeployQueueBacklog",
                        lambda p: p.update(alarmDescription="Queue is long."))
    assert len(found) == 1 and "does not link a runbook" in found[0].message


@pulumi.runtime.test
def test_public_instance_is_caught(aws_stack: StackFn) -> None:
    found = _violations(aws_stack("dev"), "instances-not-public", "fleet-blue-lt",
                        lambda p: p["networkInterfaces"][0].update(associatePublicIpAddress="true"))
    assert [v.message for v in found] == ["fleet-blue-lt: network interface associates a public IP address"]


@pytest.mark.parametrize("leak", [
    "export SPECDEPLOY_API_KEYS=ops:sk-live-0123456789abcdef",
    "AWS_ACCESS_KEY_ID=AKIAABCDEFGHIJKLMNOP",
    "-----BEGIN RSA PRIVATE KEY-----",
])
@pulumi.runtime.test
def test_secret_in_user_data_is_caught(leak: str, aws_stack: StackFn) -> None:
    def add_leak(props: dict[str, Any]) -> None:
        script = decode_user_data(props["userData"]) + f"\n{leak}\n"
        props["userData"] = encode_user_data(script)

    assert _violations(aws_stack("dev"), "no-plaintext-secret-in-user-data", "fleet-blue-lt", add_leak)


@pulumi.runtime.test
def test_public_listener_forwarding_metrics_is_caught(aws_stack: StackFn) -> None:
    def forward_metrics(props: dict[str, Any]) -> None:
        props["conditions"] = [{"pathPattern": {"values": ["/health", "/ready"]}}]

    found = _violations(aws_stack("prod"), "internal-paths-not-public", "lb-internal-paths", forward_metrics)
    assert len(found) == 1 and "forwards /metrics" in found[0].message


@pulumi.runtime.test
def test_internal_load_balancer_may_forward_internal_paths(aws_stack: StackFn) -> None:
    assert run_policy(POLICY["internal-paths-not-public"], aws_stack("staging").resources) == []
