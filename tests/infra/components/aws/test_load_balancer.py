"""LoadBalancer: internal by default, HTTPS when public, blue/green weighted forward, /ready checks."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pulumi
import pytest
import yaml

from infra.components.aws.load_balancer import TLS_POLICY, LoadBalancer, LoadBalancerArgs
from infra.components.aws.user_data import decode_user_data
from infra.config import PROJECT, load_stack
from infra.program.preview import ACCOUNT_ID, PreviewResult, new_mocks

StackFn = Callable[[str], PreviewResult]
ALB = "aws:lb/loadBalancer:LoadBalancer"
LISTENER = "aws:lb/listener:Listener"
TG = "aws:lb/targetGroup:TargetGroup"


def _forward(result: PreviewResult) -> dict[str, int]:
    listener = next(r for r in result.of_type(LISTENER) if r.inputs["defaultActions"][0]["type"] == "forward")
    groups = listener.inputs["defaultActions"][0]["forward"]["targetGroups"]
    return {g["arn"].rsplit("-", 1)[1]: g["weight"] for g in groups}


@pytest.mark.parametrize("stack", ["dev", "staging"])
@pulumi.runtime.test
def test_internal_stacks_get_an_internal_alb(stack: str, aws_stack: StackFn) -> None:
    assert aws_stack(stack).single(ALB).inputs["internal"] is True


@pulumi.runtime.test
def test_public_stack_gets_an_internet_facing_alb(aws_stack: StackFn) -> None:
    assert aws_stack("prod").single(ALB).inputs["internal"] is False


@pulumi.runtime.test
def test_public_listener_is_https_with_the_certificate_and_a_tls12_policy(aws_stack: StackFn) -> None:
    https = aws_stack("prod").one(LISTENER, "lb-https").inputs
    certificate = load_stack("prod").config.access.certificate_arn
    assert (https["protocol"], https["port"], https["certificateArn"], https["sslPolicy"]) == (
        "HTTPS", 443, certificate, TLS_POLICY)


@pulumi.runtime.test
def test_public_http_only_redirects_to_https(aws_stack: StackFn) -> None:
    action = aws_stack("prod").one(LISTENER, "lb-http-redirect").inputs["defaultActions"][0]
    assert action["type"] == "redirect" and action["redirect"]["protocol"] == "HTTPS"


@pytest.mark.parametrize("stack", ["dev", "staging", "prod"])
@pulumi.runtime.test
def test_active_slot_takes_all_traffic(stack: str, aws_stack: StackFn) -> None:
    assert _forward(aws_stack(stack)) == {"blue": 100, "green": 0}


@pulumi.runtime.test
def test_canary_weight_goes_to_the_idle_slot(aws_variant: Callable[..., PreviewResult]) -> None:
    release = load_stack("staging").config.slots.model_dump(mode="json")
    release.update(canary_weight=10, green=release["blue"])
    assert _forward(aws_variant("staging", release=release)) == {"blue": 90, "green": 10}


@pytest.mark.parametrize("stack", ["dev", "prod"])
@pulumi.runtime.test
def test_both_slots_are_health_checked_on_ready(stack: str, aws_stack: StackFn) -> None:
    checks = {r.name: r.inputs["healthCheck"]["path"] for r in aws_stack(stack).of_type(TG)}
    assert checks == {"lb-blue": "/ready", "lb-green": "/ready"}


@pytest.mark.parametrize("stack", ["dev", "prod"])
@pulumi.runtime.test
def test_deregistration_waits_for_the_servers_drain(stack: str, aws_stack: StackFn) -> None:
    drain = load_stack(stack).config.service.drain_grace_s
    assert {r.inputs["deregistrationDelay"] for r in aws_stack(stack).of_type(TG)} == {int(drain)}


@pytest.mark.parametrize("stack", ["dev", "prod"])
@pulumi.runtime.test
def test_idle_timeout_outlasts_the_request_timeout(stack: str, aws_stack: StackFn) -> None:
    timeout = load_stack(stack).config.scheduler.request_timeout_s
    assert aws_stack(stack).single(ALB).inputs["idleTimeout"] > timeout


@pytest.mark.parametrize("stack", ["dev", "staging", "prod"])
@pulumi.runtime.test
def test_the_servers_keep_idle_connections_open_longer_than_the_alb(stack: str, aws_stack: StackFn) -> None:
    """The ALB reuses its connections to a target until its idle timeout. A server that closes an idle one first
    races the ALB's next request on it, and the client gets a 502: every slot's server, as its boot script writes
    its config, keeps idle connections longer than the ALB does (AWS's advice for targets)."""
    result = aws_stack(stack)
    idle = result.single(ALB).inputs["idleTimeout"]
    templates = result.of_type("aws:ec2/launchTemplate:LaunchTemplate")
    assert templates
    for template in templates:
        script = decode_user_data(template.inputs["userData"])
        written = re.search(r"<<'SPECDEPLOY_SERVER_CONFIG'\n(.*?)SPECDEPLOY_SERVER_CONFIG", script, re.S)
        assert written is not None, "the boot script writes no server config"
        keep_alive = yaml.safe_load(written.group(1))["service"]["keep_alive_s"]
        assert keep_alive > idle, (template.name, keep_alive, idle)


@pytest.mark.parametrize("stack", ["dev", "prod"])
@pulumi.runtime.test
def test_access_logs_go_to_the_log_bucket(stack: str, aws_stack: StackFn) -> None:
    logs = aws_stack(stack).single(ALB).inputs["accessLogs"]
    assert logs["enabled"] is True and logs["bucket"] == "lb-logs"


@pulumi.runtime.test
def test_alb_waits_for_the_log_bucket_policy(aws_stack: StackFn) -> None:
    # AWS checks at creation that the ALB may write its access logs.
    assert "lb-logs-policy" in aws_stack("prod").single(ALB).depends_on


@pulumi.runtime.test
def test_log_bucket_uses_sse_s3_as_alb_requires(aws_stack: StackFn) -> None:
    sse = "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"
    rule = aws_stack("prod").one(sse, "lb-logs-encryption").inputs["rules"][0]
    assert rule["applyServerSideEncryptionByDefault"]["sseAlgorithm"] == "AES256"


@pulumi.runtime.test
def test_internal_alb_admits_only_the_configured_networks(aws_stack: StackFn) -> None:
    ingress = aws_stack("dev").one("aws:ec2/securityGroup:SecurityGroup", "lb-sg").inputs["ingress"]
    # clients on 80; the release gates of each slot (release.gate_cidrs, default the clients) on 8081/8082
    assert [(i["fromPort"], i["cidrBlocks"]) for i in ingress] == [
        (80, ["10.0.0.0/16"]), (8081, ["10.0.0.0/16"]), (8082, ["10.0.0.0/16"])]


def _args(**changes: Any) -> LoadBalancerArgs:
    base: dict[str, Any] = {"vpc_id": "vpc-1", "subnet_ids": ["s-1", "s-2"], "server_port": 8000,
                            "active_slot": "blue"}
    return LoadBalancerArgs(**{**base, **changes})




def test_unknown_active_slot_is_refused() -> None:
    with pytest.raises(ValueError, match=r"release\.active"):
        _args(active_slot="red")


_built: dict[str, LoadBalancer] = {}


def _lb() -> LoadBalancer:
    if "lb" not in _built:
        pulumi.runtime.set_mocks(new_mocks(), project=PROJECT, stack="unit", preview=False)
        _built["lb"] = LoadBalancer("lb", _args(public=True, certificate_arn="arn:aws:acm:us-east-1:1:certificate/x",
                                                allowed_cidrs=["0.0.0.0/0"], domain="llm.example.com"))
    return _built["lb"]


@pulumi.runtime.test
def test_output_endpoint_is_https_on_the_domain() -> pulumi.Output[None]:
    def check(endpoint: str) -> None:
        assert endpoint == "https://llm.example.com"

    return _lb().endpoint.apply(check)


@pulumi.runtime.test
def test_output_has_a_target_group_per_slot() -> pulumi.Output[None]:
    def check(arns: dict[str, str]) -> None:
        # the mocks name an ARN after the resource: each slot's ARN must be its own target group's
        assert arns == {slot: f"arn:aws:lb:us-east-1:{ACCOUNT_ID}:lb-{slot}" for slot in ("blue", "green")}

    return pulumi.Output.all(**_lb().target_group_arns).apply(check)
