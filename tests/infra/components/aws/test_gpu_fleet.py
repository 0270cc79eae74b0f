"""GpuFleet: hardened launch template, least-privilege role, ELB-checked group, queue-based scaling."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pulumi
import pytest

from infra.capacity import plan, weight_cache_gib
from infra.components.aws.gpu_fleet import GpuFleetArgs
from infra.components.aws.user_data import UserDataSpec, decode_user_data
from infra.config import load_stack
from infra.program.preview import PreviewResult
from serving import metric_names as m

StackFn = Callable[[str], PreviewResult]
VariantFn = Callable[..., PreviewResult]
STACKS = ("dev", "staging", "prod")
LT = "aws:ec2/launchTemplate:LaunchTemplate"
ASG = "aws:autoscaling/group:Group"


def _template(result: PreviewResult) -> dict[str, Any]:
    return result.single(LT).inputs


def _role_policy(result: PreviewResult) -> list[dict[str, Any]]:
    statements: list[dict[str, Any]] = json.loads(result.single("aws:iam/rolePolicy:RolePolicy").inputs["policy"])[
        "Statement"]
    return statements


def _statement(result: PreviewResult, sid: str) -> dict[str, Any]:
    return next(s for s in _role_policy(result) if s["Sid"] == sid)


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_imds_v2_is_required(stack: str, aws_stack: StackFn) -> None:
    assert _template(aws_stack(stack))["metadataOptions"]["httpTokens"] == "required"


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_containers_cannot_reach_instance_metadata(stack: str, aws_stack: StackFn) -> None:
    assert _template(aws_stack(stack))["metadataOptions"]["httpPutResponseHopLimit"] == 1


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_instances_get_no_public_address(stack: str, aws_stack: StackFn) -> None:
    assert _template(aws_stack(stack))["networkInterfaces"][0]["associatePublicIpAddress"] == "false"


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_root_volume_is_encrypted_gp3(stack: str, aws_stack: StackFn) -> None:
    ebs = _template(aws_stack(stack))["blockDeviceMappings"][0]["ebs"]
    assert (ebs["encrypted"], ebs["volumeType"]) == ("true", "gp3")


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_root_volume_holds_the_weight_cache(stack: str, aws_stack: StackFn) -> None:
    cache = weight_cache_gib(plan(load_stack(stack).config).estimate)
    assert _template(aws_stack(stack))["blockDeviceMappings"][0]["ebs"]["volumeSize"] >= cache


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_instance_type_is_the_plans(stack: str, aws_stack: StackFn) -> None:
    assert _template(aws_stack(stack))["instanceType"] == plan(load_stack(stack).config).instance.name


@pulumi.runtime.test
def test_ami_comes_from_the_ssm_parameter(aws_stack: StackFn) -> None:
    assert _template(aws_stack("dev"))["imageId"] == "ami-0123456789abcdef0"  # the mocked SSM answer


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_user_data_pulls_the_slot_image_by_digest(stack: str, aws_stack: StackFn) -> None:
    script = decode_user_data(_template(aws_stack(stack))["userData"])
    assert f"IMAGE={load_stack(stack).config.slots.blue.image}" in script  # type: ignore[union-attr]


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_group_uses_elb_health_checks_with_a_warmup_grace(stack: str, aws_stack: StackFn) -> None:
    group = aws_stack(stack).single(ASG).inputs
    assert (group["healthCheckType"], group["healthCheckGracePeriod"]) == (
        "ELB", load_stack(stack).config.fleet.warmup_s)


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_group_sizes_follow_the_fleet(stack: str, aws_stack: StackFn) -> None:
    fleet = load_stack(stack).config.fleet
    group = aws_stack(stack).single(ASG).inputs
    assert (group["minSize"], group["maxSize"]) == (fleet.min_size, fleet.max_size)


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_group_registers_with_its_slots_target_group(stack: str, aws_stack: StackFn) -> None:
    assert aws_stack(stack).single(ASG).inputs["targetGroupArns"] == ["arn:aws:lb:us-east-1:123456789012:lb-blue"]


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_scaling_tracks_waiting_requests_per_instance(stack: str, aws_stack: StackFn) -> None:
    tracking = aws_stack(stack).single("aws:autoscaling/policy:Policy").inputs["targetTrackingConfiguration"]
    metric = tracking["customizedMetricSpecification"]
    assert (metric["metricName"], metric["statistic"], tracking["targetValue"]) == (
        m.WAITING, "Average", load_stack(stack).config.fleet.queue_target_per_instance)


@pulumi.runtime.test
def test_prod_raises_the_baseline_on_weekday_peaks(aws_stack: StackFn) -> None:
    schedules = {r.inputs["scheduledActionName"]: (r.inputs["recurrence"], r.inputs["minSize"])
                 for r in aws_stack("prod").of_type("aws:autoscaling/schedule:Schedule")}
    assert schedules == {"weekday-peak": ("0 8 * * 1-5", 4), "weekday-offpeak": ("0 20 * * 1-5", 2)}


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_role_reads_only_the_slots_model_prefixes(stack: str, aws_stack: StackFn) -> None:
    slot = load_stack(stack).config.slots.blue
    assert slot is not None
    expected = sorted(f"arn:aws:s3:::{uri[len('s3://'):]}/*" for uri in (slot.model_version, slot.draft_version) if uri)
    assert sorted(_statement(aws_stack(stack), "ReadModelVersions")["Resource"]) == expected


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_role_has_no_wildcard_actions(stack: str, aws_stack: StackFn) -> None:
    actions = [a for s in _role_policy(aws_stack(stack)) for a in ([s["Action"]] if isinstance(s["Action"], str)
                                                                    else s["Action"])]
    assert not [a for a in actions if a.endswith("*")]


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_role_reads_only_the_api_key_secret(stack: str, aws_stack: StackFn) -> None:
    assert _statement(aws_stack(stack), "ReadApiKeys")["Resource"] == \
        "arn:aws:secretsmanager:us-east-1:123456789012:api-keys-secret"


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_metrics_may_only_go_to_the_specdeploy_namespace(stack: str, aws_stack: StackFn) -> None:
    condition = _statement(aws_stack(stack), "PublishMetrics")["Condition"]
    assert condition == {"StringEquals": {"cloudwatch:namespace": "Specdeploy"}}


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_server_port_is_open_only_to_the_load_balancer(stack: str, aws_stack: StackFn) -> None:
    rule = aws_stack(stack).single("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule").inputs
    assert (rule["referencedSecurityGroupId"], rule["fromPort"], rule.get("cidrIpv4")) == ("lb-sg-id", 8000, None)


@pulumi.runtime.test
def test_on_demand_fleet_uses_the_launch_template_directly(aws_stack: StackFn) -> None:
    group = aws_stack("dev").single(ASG).inputs
    assert group["launchTemplate"]["id"] == "fleet-blue-lt-id" and "mixedInstancesPolicy" not in group


@pulumi.runtime.test
def test_mixed_fleet_keeps_an_on_demand_base_and_fills_with_spot(aws_variant: VariantFn) -> None:
    group = aws_variant("staging", fleet={"capacity_type": "mixed", "on_demand_base": 1}).single(ASG).inputs
    distribution = group["mixedInstancesPolicy"]["instancesDistribution"]
    assert (distribution["onDemandBaseCapacity"], distribution["onDemandPercentageAboveBaseCapacity"]) == (1, 0)



def _fleet_args(**changes: Any) -> GpuFleetArgs:
    config = load_stack("dev").config
    slot = config.slots.blue
    assert slot is not None
    boot = UserDataSpec(stack="dev", slot="blue", region="us-east-1", image=changes.pop("image", slot.image),
                        model_uri=changes.pop("model_uri", slot.model_version), draft_uri=None,
                        model_dir="/data/models/target", draft_dir=None, cache_dir="/data/models",
                        server_config_yaml="", secret_id="s", log_group="l", prometheus_log_group="p", port=8000,
                        drain_grace_s=30, ready_timeout_s=900)
    fleet = config.fleet.model_copy(update=changes.pop("fleet", {}))
    return GpuFleetArgs(boot=boot, bucket_name="acme-specdeploy-models-dev", instance_type="g6e.xlarge",
                        fleet=fleet, weight_cache_gb=changes.pop("weight_cache_gb", 32), vpc_id="v", subnet_ids=[],
                        lb_security_group_id="sg", target_group_arn="tg", repository_arn="r", secret_arn="s")


def test_image_by_tag_is_refused() -> None:
    with pytest.raises(ValueError, match=r"release\.blue\.image must pin a digest"):
        _fleet_args(image="specdeploy-server:latest")


def test_weights_outside_the_model_store_are_refused() -> None:
    with pytest.raises(ValueError, match=r"release\.blue\.model_version: s3://elsewhere/m is not a version inside"):
        _fleet_args(model_uri="s3://elsewhere/m")


def test_root_volume_too_small_for_the_cache_is_refused() -> None:
    with pytest.raises(ValueError, match=r"fleet\.root_volume_gb \(150\) is below 260 GiB"):
        _fleet_args(weight_cache_gb=200)
