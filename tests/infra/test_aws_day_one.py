"""Issue 12: what AWS does on the first day in a real account, modelled and checked against every AWS stack."""

from __future__ import annotations

import json
import re
import tomllib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import pulumi
import pytest
import yaml

from infra.components.aws.network import INTERFACE_ENDPOINTS
from infra.components.aws.release_artifacts import missing_artifacts
from infra.components.aws.user_data import PUBLISHED_GAUGES, PUBLISHED_HISTOGRAMS, decode_user_data
from infra.config import load_stack, render_server_config
from infra.program.preview import PreviewResult

StackFn = Callable[[str], PreviewResult]
STACKS = ("dev", "staging", "prod")
ROOT = Path(__file__).resolve().parents[2]
ASG = "aws:autoscaling/group:Group"
ALARM = "aws:cloudwatch/metricAlarm:MetricAlarm"

# Input that holds the physical name of each explicitly named AWS resource type.
PHYSICAL_NAME = {
    "aws:ecr/repository:Repository": "name",
    "aws:s3/bucket:Bucket": "bucket",
    "aws:secretsmanager/secret:Secret": "name",
    "aws:iam/role:Role": "name",
    "aws:lb/loadBalancer:LoadBalancer": "name",
    "aws:lb/targetGroup:TargetGroup": "name",
    "aws:cloudwatch/logGroup:LogGroup": "name",
    ALARM: "name",
    "aws:cloudwatch/dashboard:Dashboard": "dashboardName",
    "aws:sns/topic:Topic": "name",
}


def _named(result: PreviewResult) -> list[tuple[str, str, str]]:
    """(account/region scope, type, physical name) of every explicitly named resource in one stack."""
    region = yaml.safe_load(load_stack(result.stack).path.read_text())["config"]["aws:region"]
    return [(region, r.type, r.inputs[key])
            for r in result.resources for t, key in PHYSICAL_NAME.items() if r.type == t and key in r.inputs]


@pulumi.runtime.test
def test_explicit_names_are_unique_per_account_and_region_across_every_aws_stack(aws_stack: StackFn) -> None:
    # All stacks share one account (the stack files' ARNs name 123456789012); AWS refuses a second resource
    # of a type with the same name in an account and region (RepositoryAlreadyExists, BucketAlreadyOwnedByYou...).
    counts = Counter(name for stack in STACKS for name in _named(aws_stack(stack)))
    assert [name for name, count in counts.items() if count > 1] == []


@pulumi.runtime.test
def test_every_stack_creates_its_repository_without_a_conflict_in_one_account(
        aws_stack: StackFn, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _moto(monkeypatch, moto_endpoint)
    ecr = boto3.client("ecr", region_name="us-east-1")
    for stack in STACKS:  # what `pulumi up` does for each stack in turn; raises RepositoryAlreadyExistsException
        ecr.create_repository(repositoryName=aws_stack(stack).single("aws:ecr/repository:Repository").inputs["name"])


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_secret_gets_a_new_name_on_every_creation(stack: str, aws_stack: StackFn) -> None:
    # Deleted secrets keep their name for the recovery window; only a prefix survives destroy + re-create.
    secret = aws_stack(stack).single("aws:secretsmanager/secret:Secret")
    assert "name" not in secret.inputs and secret.inputs["namePrefix"].startswith(f"specdeploy/{stack}/")


def _moto(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")).close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(key, value)


# ---- bootstrap: an empty account gets no instances --------------------------------------------------------

def test_empty_account_lacks_the_image_and_the_manifest_until_both_are_pushed(
        moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _moto(monkeypatch, moto_endpoint)
    ecr, s3 = boto3.client("ecr", region_name="us-east-1"), boto3.client("s3", region_name="us-east-1")
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "size": 2,
                                      "digest": "sha256:" + "0" * 64}, "layers": []})
    uri = "s3://acme-models-dev/model/v1"
    assert len(missing_artifacts(ecr, s3, "1.dkr.ecr.us-east-1.amazonaws.com/specdeploy-dev@sha256:" + "a" * 64,
                                 [uri])) == 2  # the first `pulumi up`: nothing exists
    ecr.create_repository(repositoryName="specdeploy-dev")
    s3.create_bucket(Bucket="acme-models-dev")
    digest = ecr.put_image(repositoryName="specdeploy-dev", imageManifest=manifest,
                           imageTag="v1")["image"]["imageId"]["imageDigest"]
    image = f"1.dkr.ecr.us-east-1.amazonaws.com/specdeploy-dev@{digest}"
    assert missing_artifacts(ecr, s3, image, [uri]) == ["weights manifest s3://acme-models-dev/model/v1/manifest.json "
                                                        "does not exist"]
    s3.put_object(Bucket="acme-models-dev", Key="model/v1/manifest.json", Body=b"{}")
    assert missing_artifacts(ecr, s3, image, [uri]) == []


@pulumi.runtime.test
def test_a_slot_image_outside_the_stack_repository_is_refused(aws_variant: Callable[..., PreviewResult]) -> None:
    image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/specdeploy-server@sha256:" + "3" * 64
    uri = "s3://acme-specdeploy-models-prod/llama-3.1-8b-instruct/2026-11-28"
    with pytest.raises(Exception, match="not in this stack's repository 'specdeploy-prod'"):
        aws_variant("prod", release={"active": "blue", "blue": {
            "image": image, "model_version": uri,
            "draft_version": "s3://acme-specdeploy-models-prod/llama-3.2-1b-instruct/2026-11-28"}})


# ---- the autoscaler owns the running size ------------------------------------------------------------------

def _refresh_diff(desired_input: dict[str, Any], live: dict[str, Any], ignored: tuple[str, ...]) -> set[str]:
    """What `pulumi up --refresh` would change: inputs differing from the refreshed state, less ignore_changes."""
    return {key for key, value in desired_input.items() if key not in ignored and live.get(key) != value}


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_refresh_after_a_scale_out_leaves_the_group_size_to_the_autoscaler(
        stack: str, aws_stack: StackFn, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _moto(monkeypatch, moto_endpoint)
    group = aws_stack(stack).of_type(ASG)[0]
    autoscaling = boto3.client("autoscaling", region_name="us-east-1")
    ec2 = boto3.client("ec2", region_name="us-east-1")
    ec2.create_launch_template(LaunchTemplateName="specdeploy-lt", LaunchTemplateData={"ImageId": "ami-12345678",
                                                                            "InstanceType": "t3.micro"})
    inputs = {k: group.inputs[k] for k in ("minSize", "maxSize", "desiredCapacity")}
    autoscaling.create_auto_scaling_group(
        AutoScalingGroupName="asg", MinSize=inputs["minSize"], MaxSize=inputs["maxSize"],
        DesiredCapacity=inputs["desiredCapacity"], LaunchTemplate={"LaunchTemplateName": "specdeploy-lt"},
        AvailabilityZones=["us-east-1a"])
    autoscaling.set_desired_capacity(AutoScalingGroupName="asg", DesiredCapacity=inputs["maxSize"])  # peak
    live_group = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=["asg"])["AutoScalingGroups"][0]
    live = {"minSize": live_group["MinSize"], "maxSize": live_group["MaxSize"],
            "desiredCapacity": live_group["DesiredCapacity"]}
    assert _refresh_diff(inputs, live, group.ignore_changes) == set()


# ---- every alarm has a publisher ---------------------------------------------------------------------------

def _user_data(result: PreviewResult) -> str:
    template = result.of_type("aws:ec2/launchTemplate:LaunchTemplate")[0]
    return decode_user_data(template.inputs["userData"])


def _heredoc(script: str, marker: str) -> str:
    return script.split(f"<<'{marker}'\n", 1)[1].split(f"\n{marker}", 1)[0]


def _published(result: PreviewResult) -> set[tuple[str, str, frozenset[str]]]:
    """(namespace, metric, dimension names) of every series something rendered for this stack publishes."""
    agent = json.loads(_heredoc(_user_data(result), "SPECDEPLOY_CW_AGENT"))
    series: set[tuple[str, str, frozenset[str]]] = set()
    metrics = agent["metrics"]
    rollups = [frozenset(d) for d in metrics.get("aggregation_dimensions", [])]
    for section, body in metrics["metrics_collected"].items():
        prefix = {"nvidia_gpu": "nvidia_smi_"}.get(section, "")
        for measurement in body.get("measurement", []):
            series.update((metrics["namespace"], prefix + measurement, dims) for dims in rollups)
    emf = agent["logs"]["metrics_collected"]["prometheus"]["emf_processor"]
    for declaration in emf["metric_declaration"]:
        for selector in declaration["metric_selectors"]:
            series.update((emf["metric_namespace"], selector.strip("^$"), frozenset(d))
                          for d in declaration["dimensions"])
    publisher = _heredoc(_user_data(result), "SPECDEPLOY_PUBLISHER")
    series.update(("Specdeploy", name, frozenset({"AutoScalingGroupName"}))
                  for name in PUBLISHED_HISTOGRAMS if name in publisher)
    # The load balancer publishes its own per-ALB and per-target-group series.
    for metric in ("RequestCount", "HTTPCode_Target_5XX_Count", "HTTPCode_ELB_5XX_Count"):
        series.add(("AWS/ApplicationELB", metric, frozenset({"LoadBalancer"})))
    for metric in ("UnHealthyHostCount", "HealthyHostCount", "RequestCount", "HTTPCode_Target_5XX_Count"):
        series.add(("AWS/ApplicationELB", metric, frozenset({"LoadBalancer", "TargetGroup"})))
    return series


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_every_alarm_reads_a_series_that_something_rendered_publishes(stack: str, aws_stack: StackFn) -> None:
    result = aws_stack(stack)
    published = _published(result)
    read = {(q["metric"]["namespace"], q["metric"]["metricName"], frozenset(q["metric"]["dimensions"]))
            for alarm in result.of_type(ALARM) for q in alarm.inputs["metricQueries"] if "metric" in q}
    assert read and read - published == set()
    assert set(PUBLISHED_GAUGES) <= {name for _, name, _ in published}


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_agent_needs_no_describe_tags_the_private_subnets_cannot_reach(stack: str, aws_stack: StackFn) -> None:
    # ${aws:AutoScalingGroupName} makes the agent call EC2 DescribeTags; the VPC has no NAT and no ec2 endpoint.
    agent = _heredoc(_user_data(aws_stack(stack)), "SPECDEPLOY_CW_AGENT")
    assert "${aws:" not in agent or "ec2" in INTERFACE_ENDPOINTS


def test_serve_extra_carries_nvml_for_the_gpu_gauges() -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serve"]
    assert any(re.match(r"nvidia-ml-py\b", requirement) for requirement in extra)


# ---- no page while instances boot --------------------------------------------------------------------------

def _minutes_unhealthy_while_booting(group: dict[str, Any], warmup_s: int, health_interval_s: int = 15,
                                     healthy_threshold: int = 2) -> int:
    """Minutes an instance counts in UnHealthyHostCount on a normal boot that becomes ready after warmup_s.

    AWS registers an instance with the group's target groups at InService; with a launch lifecycle hook
    that is when the hook completes (user-data completes it after /ready), without one right at launch.
    Until the health check passes `healthy_threshold` times the target is not healthy.
    """
    hooks = [h for h in group.get("initialLifecycleHooks", [])
             if h["lifecycleTransition"] == "autoscaling:EC2_INSTANCE_LAUNCHING"]
    registered_at = warmup_s if hooks and hooks[0]["heartbeatTimeout"] >= warmup_s else 0
    healthy_at = max(warmup_s, registered_at) + health_interval_s * healthy_threshold
    return (healthy_at - registered_at + 59) // 60


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_a_normal_boot_does_not_fire_the_unhealthy_hosts_alarm(stack: str, aws_stack: StackFn) -> None:
    result = aws_stack(stack)
    alarm = next(a for a in result.of_type(ALARM) if a.inputs["name"].endswith("SpecdeployUnhealthyHosts"))
    for group in result.of_type(ASG):
        unhealthy = _minutes_unhealthy_while_booting(group.inputs, result.config.fleet.warmup_s)
        assert unhealthy < alarm.inputs["datapointsToAlarm"], group.name


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_user_data_completes_the_launch_hook_only_after_ready(stack: str, aws_stack: StackFn) -> None:
    script = _user_data(aws_stack(stack))
    ready = script.index('log "ready on port $PORT"')
    assert script.index("--lifecycle-action-result CONTINUE") > ready
    assert "autoscaling" in INTERFACE_ENDPOINTS  # the call reaches the API from a private subnet


# ---- internal endpoints stay internal ----------------------------------------------------------------------

@pulumi.runtime.test
def test_public_listener_answers_internal_paths_itself(aws_stack: StackFn) -> None:
    rules = aws_stack("prod").of_type("aws:lb/listenerRule:ListenerRule")
    paths = {v for r in rules if r.inputs["actions"][0]["type"] == "fixed-response"
             for c in r.inputs["conditions"] for v in c["pathPattern"]["values"]}
    assert {"/metrics", "/health", "/ready"} <= paths


# ---- GPU or nothing ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("stack", [*STACKS, "k8s-prod"])
def test_gpu_stacks_render_device_cuda(stack: str) -> None:
    assert render_server_config(load_stack(stack).config).model.device == "cuda"


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_instances_receive_device_cuda(stack: str, aws_stack: StackFn) -> None:
    written = yaml.safe_load(_heredoc(_user_data(aws_stack(stack)), "SPECDEPLOY_SERVER_CONFIG"))
    assert written["model"]["device"] == "cuda"


def test_local_stack_keeps_device_auto() -> None:
    assert render_server_config(load_stack("local").config).model.device == "auto"
