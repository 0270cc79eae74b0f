"""Fixtures for the release tests: a loopback moto_server with a weighted ALB and the stack's
alarms, a fake slot server whose /ready and /metrics the test controls, and a stack file copy."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from infra.alerts import alert_rules
from infra.config import load_stack, project_stacks_dir
from serving import metric_names as m
from tests.loopback import loopback_http

GREEN = {
    "image": "123456789012.dkr.ecr.us-east-1.amazonaws.com/specdeploy-prod@sha256:" + "4" * 64,  # the stack's repo
    "model_version": "s3://acme-specdeploy-models-prod/llama-3.1-8b-instruct/2026-12-02",
    # prod speculates with a draft model, so every slot names its draft (the stack schema checks it)
    "draft_version": "s3://acme-specdeploy-models-prod/llama-3.2-1b-instruct/2026-12-02",
}
MODEL_BUCKET = "acme-specdeploy-models-prod"  # stacks/Pulumi.prod.yaml's model bucket
ALARM_PREFIX = "prod-"  # the alerting component names alarms <stack>-<slot>-<RuleName>
RUNBOOKS = "https://example.com/runbooks"


@dataclass
class AwsRelease:
    """What the fixture created in moto, plus a record of every AWS API call the code under test made."""

    listener_arn: str
    target_groups: dict[str, str]
    alarm_names: list[str]
    calls: list[str] = field(default_factory=list)  # "elasticloadbalancing.ModifyListener", ...

    def weights(self) -> dict[str, int]:
        import boto3

        listener = boto3.client("elbv2").describe_listeners(ListenerArns=[self.listener_arn])["Listeners"][0]
        groups = listener["DefaultActions"][0]["ForwardConfig"]["TargetGroups"]
        by_arn = {g["TargetGroupArn"]: g["Weight"] for g in groups}
        return {slot: by_arn[arn] for slot, arn in self.target_groups.items()}

    def set_weights(self, weights: dict[str, int]) -> None:
        """Route directly (the test's own call, not recorded as the code under test's)."""
        import boto3

        boto3.client("elbv2").modify_listener(
            ListenerArn=self.listener_arn,
            DefaultActions=[{"Type": "forward", "ForwardConfig": {"TargetGroups": [
                {"TargetGroupArn": self.target_groups[slot], "Weight": weight} for slot, weight in weights.items()]}}])
        self.calls.clear()

    def count(self, operation: str) -> int:
        return sum(1 for call in self.calls if call.endswith(f".{operation}"))

    def set_alarm(self, rule_name: str, state: str = "ALARM", slot: str = "green") -> None:
        import boto3

        boto3.client("cloudwatch").set_alarm_state(
            AlarmName=f"{ALARM_PREFIX}{slot}-{rule_name}", StateValue=state, StateReason=f"test set {state}")

    def paging(self) -> dict[str, bool]:
        """slot -> whether its alarms have actions enabled (all of them; a mix fails the test)."""
        import boto3

        alarms = boto3.client("cloudwatch").describe_alarms(AlarmNames=self.alarm_names)["MetricAlarms"]
        by_slot: dict[str, set[bool]] = {}
        for alarm in alarms:
            slot = alarm["AlarmName"].removeprefix(ALARM_PREFIX).split("-", 1)[0]
            by_slot.setdefault(slot, set()).add(bool(alarm["ActionsEnabled"]))
        assert all(len(states) == 1 for states in by_slot.values()), by_slot
        return {slot: states.pop() for slot, states in sorted(by_slot.items())}

    def cli_args(self) -> list[str]:
        return ["--listener-arn", self.listener_arn,
                "--target-group", f"blue={self.target_groups['blue']}",
                "--target-group", f"green={self.target_groups['green']}"]


@pytest.fixture(scope="session")
def aws_world(moto_endpoint: str) -> Iterator[AwsRelease]:
    """Created once per session: an ALB whose listener forwards to blue/green target groups, a healthy
    target in each, and one CloudWatch alarm per rule of the prod stack."""
    import boto3

    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": moto_endpoint, "MOTO_EC2_LOAD_DEFAULT_AMIS": "false"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        for name in ("AWS_PROFILE", "SPECDEPLOY_LISTENER_ARN", "SPECDEPLOY_ALARM_PREFIX", "SPECDEPLOY_GREEN_ENDPOINT",
                     "SPECDEPLOY_BLUE_ENDPOINT", "SPECDEPLOY_BLUE_TARGET_GROUP_ARN",
                     "SPECDEPLOY_GREEN_TARGET_GROUP_ARN"):
            patch.delenv(name, raising=False)
        # A session of our own: the code under test creates its clients from boto3's default session.
        boto3.setup_default_session(region_name="us-east-1")
        ec2, elbv2, cloudwatch = boto3.client("ec2"), boto3.client("elbv2"), boto3.client("cloudwatch")
        vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
        subnets = [ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.0.{i}.0/24", AvailabilityZone=f"us-east-1{az}")
                   ["Subnet"]["SubnetId"] for i, az in ((1, "a"), (2, "b"))]
        lb = elbv2.create_load_balancer(Name="specdeploy-prod", Subnets=subnets, Scheme="internal",
                                        Type="application")["LoadBalancers"][0]["LoadBalancerArn"]
        groups = {slot: elbv2.create_target_group(
            Name=f"specdeploy-prod-{slot}", Protocol="HTTP", Port=8000, VpcId=vpc, TargetType="instance",
            HealthCheckPath="/ready")["TargetGroups"][0]["TargetGroupArn"] for slot in ("blue", "green")}
        listener = elbv2.create_listener(
            LoadBalancerArn=lb, Protocol="HTTP", Port=80,
            DefaultActions=[{"Type": "forward", "ForwardConfig": {"TargetGroups": [
                {"TargetGroupArn": groups["blue"], "Weight": 100},
                {"TargetGroupArn": groups["green"], "Weight": 0}]}}],
        )["Listeners"][0]["ListenerArn"]
        instances = ec2.run_instances(ImageId="ami-12345678", MinCount=2, MaxCount=2, InstanceType="g5.xlarge",
                                      SubnetId=subnets[0])["Instances"]
        for slot, instance in zip(("blue", "green"), instances, strict=True):
            elbv2.register_targets(TargetGroupArn=groups[slot], Targets=[{"Id": instance["InstanceId"], "Port": 8000}])
        names = []
        for slot in ("blue", "green"):  # one alarm per rule and slot, as the alerting component renders them
            for rule in alert_rules(load_stack("prod").config):
                name = f"{ALARM_PREFIX}{slot}-{rule.name}"
                cloudwatch.put_metric_alarm(
                    AlarmName=name, Namespace="Specdeploy", MetricName=rule.name, Statistic="Maximum", Period=60,
                    EvaluationPeriods=rule.for_minutes, Threshold=rule.threshold,
                    ComparisonOperator="GreaterThanThreshold", AlarmDescription=rule.description(RUNBOOKS),
                    ActionsEnabled=slot == "blue", AlarmActions=["arn:aws:sns:us-east-1:123456789012:pager"])
                names.append(name)
        boto3.client("s3").create_bucket(Bucket=MODEL_BUCKET)  # the release lock and audit trail live there
        world = AwsRelease(listener, groups, names)

        def record(event_name: str, **_: Any) -> None:
            world.calls.append(event_name.removeprefix("before-call."))

        boto3.DEFAULT_SESSION.events.register("before-call", record)  # type: ignore[union-attr]
        yield world
        boto3.DEFAULT_SESSION = None


@pytest.fixture
def aws_release(aws_world: AwsRelease) -> AwsRelease:
    """The session's AWS world back at its starting point: 100 % blue, every alarm OK, no calls recorded."""
    import boto3

    aws_world.set_weights({"blue": 100, "green": 0})
    cloudwatch = boto3.client("cloudwatch")
    cloudwatch.enable_alarm_actions(AlarmNames=[n for n in aws_world.alarm_names if "-blue-" in n])
    cloudwatch.disable_alarm_actions(AlarmNames=[n for n in aws_world.alarm_names if "-green-" in n])
    for alarm in cloudwatch.describe_alarms(AlarmNames=aws_world.alarm_names)["MetricAlarms"]:
        if alarm["StateValue"] != "OK":
            cloudwatch.set_alarm_state(AlarmName=alarm["AlarmName"], StateValue="OK", StateReason="fixture")
    aws_world.calls.clear()
    return aws_world

@pytest.fixture
def s3(aws_release: AwsRelease) -> Iterator[Any]:
    """An S3 client on the session's moto; the release lock and audit objects are removed afterwards."""
    import boto3

    client = boto3.client("s3")
    yield client
    for prefix in ("release-lock/", "release-audit/"):
        for item in client.list_objects_v2(Bucket=MODEL_BUCKET, Prefix=prefix).get("Contents", []):
            client.delete_object(Bucket=MODEL_BUCKET, Key=item["Key"])



@dataclass
class SlotServer:
    """A stand-in for one slot's server: /ready and a Prometheus /metrics the test moves."""

    url: str = ""
    ready: bool = True
    ok_requests: int = 0
    error_requests: int = 0
    latencies: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def serve(self, requests: int, errors: int = 0, latency_s: float = 0.4) -> None:
        """Pretend ``requests`` requests finished, ``errors`` of them with a 500."""
        with self.lock:
            self.ok_requests += requests - errors
            self.error_requests += errors
            self.latencies += [latency_s] * requests

    def metrics(self) -> str:
        with self.lock:
            lines = [f'{m.REQUESTS}_total{{endpoint="/v1/chat/completions",status="200"}} {self.ok_requests}',
                     f'{m.REQUESTS}_total{{endpoint="/v1/chat/completions",status="500"}} {self.error_requests}']
            for le in (0.5, 1.0, 5.0, 10.0, 40.0, 80.0):
                count = sum(1 for x in self.latencies if x <= le)
                lines.append(f'{m.E2E}_bucket{{le="{le}"}} {count}')
            lines.append(f'{m.E2E}_bucket{{le="+Inf"}} {len(self.latencies)}')
            lines.append(f"{m.E2E}_count {len(self.latencies)}")
        return "\n".join(lines) + "\n"


@pytest.fixture
def slot_server() -> Iterator[SlotServer]:
    slot = SlotServer()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path == "/ready":
                status, body = (200, b"ready") if slot.ready else (503, b"not ready")
            elif self.path == "/metrics":
                # Traffic keeps flowing to the slot while the gates watch it.
                slot.serve(10)
                status, body = 200, slot.metrics().encode()
            else:
                status, body = 404, b""
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    with loopback_http(Handler) as url:
        slot.url = url
        yield slot


@pytest.fixture
def prod_copy(tmp_path: Path) -> Path:
    """stacks/Pulumi.prod.yaml copied into tmp_path with the green slot filled in (step 1 of rollout.md)."""
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    text = (project_stacks_dir() / "Pulumi.prod.yaml").read_text(encoding="utf-8")
    marker = "  specdeploy:apiKeys:"
    green = "    green:\n" + "".join(f"      {k}: {v}\n" for k, v in GREEN.items())
    assert marker in text
    (stacks / "Pulumi.prod.yaml").write_text(text.replace(marker, green + marker), encoding="utf-8")
    shutil.copy(project_stacks_dir() / "Pulumi.k8s-prod.yaml", stacks / "Pulumi.k8s-prod.yaml")
    return stacks


@pytest.fixture
def kubeconfig(api_server: Any, tmp_path: Path) -> Path:
    """A kubeconfig pointing at the test module's loopback API server (its `api_server` fixture)."""
    import yaml

    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": api_server.url}}],
        "users": [{"name": "test", "user": {"token": "test-token"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
    }))
    return path


def rbac_request(method: str, path: str) -> tuple[str, str, str, str, str | None] | None:
    """(verb, apiGroup, resource[/subresource], namespace, object name or None) the API server authorizes a
    request by; None for a path that is not a namespaced Kubernetes API call (the stand-in also answers as
    Prometheus)."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) > 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    if len(rest) < 3 or rest[0] != "namespaces":
        return None
    namespace, resource, named = rest[1], rest[2], rest[3:]
    if len(named) >= 2:  # a subresource: pods/<name>:<port>/proxy/...
        resource = f"{resource}/{named[1]}"
    verbs = {"GET": "get" if named else "list", "POST": "create", "PUT": "update", "PATCH": "patch",
             "DELETE": "delete"}
    return verbs[method], group, resource, namespace, named[0] if named else None


def rbac_check(calls: list[tuple[str, str]], role: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(requests the Role denies, rule grants no request used) for the recorded (method, path) calls.

    As the API server authorizes: a rule admits a request when its verb, API group and resource match, and,
    if the rule lists resourceNames, the request names one of them (a list or create names no object, so such
    a rule never admits one)."""
    requests = {r for r in (rbac_request(m, p) for m, p in calls) if r is not None}
    namespace = role["metadata"]["namespace"]

    def admits(rule: dict[str, Any], verb: str, group: str, resource: str, name: str | None) -> bool:
        names = rule.get("resourceNames") or rule.get("resource_names")
        return (verb in rule["verbs"] and group in rule["apiGroups"] and resource in rule["resources"]
                and (not names or name in names))

    denied = sorted(f"{v} {g or 'core'}/{r}{'/' + n if n else ''} in {ns}" for v, g, r, ns, n in requests
                    if ns != namespace or not any(admits(rule, v, g, r, n) for rule in role["rules"]))
    granted = {(verb, group, resource) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    used = {(v, g, r) for v, g, r, _, _ in requests}
    unused = sorted(f"{v} {g or 'core'}/{r}" for v, g, r in granted - used)
    return denied, unused
