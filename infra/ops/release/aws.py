"""AWS: the ALB listener's weighted forward action, target health, CloudWatch alarms.

The load balancer component (``infra/components/aws/load_balancer.py``) creates one
listener whose default action forwards to the blue and green target groups by
weight. A shift rewrites that action's weights in one ``ModifyListener`` call and
keeps everything else in it (stickiness, the order of the groups) as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from infra.alerts import AlertRule
from infra.ops.release.model import SLOTS, ReleaseError, Weights
from infra.ops.release.traffic import FiringAlarm, SlotStatus


def client(service: str, region: str | None = None) -> Any:
    """A boto3 client; AWS_ENDPOINT_URL (e.g. a loopback moto_server) is honoured by boto3 itself."""
    import boto3

    if logging.getLogger().level > logging.DEBUG:  # credential/endpoint chatter only with --verbose
        logging.getLogger("botocore").setLevel(logging.WARNING)

    return boto3.client(service, region_name=region) if region else boto3.client(service)


class AlbRouter:
    def __init__(self, elbv2: Any, listener_arn: str, target_groups: Mapping[str, str], ec2: Any = None,
                 server_port: int | None = None) -> None:
        missing = [slot for slot in SLOTS if not target_groups.get(slot)]
        if missing:
            raise ReleaseError(f"no target group ARN for slot(s) {', '.join(missing)}")
        self.elbv2 = elbv2
        self.ec2 = ec2
        self.listener_arn = listener_arn
        self.target_groups = dict(target_groups)
        self.server_port = server_port
        self.description = f"ALB listener {listener_arn}"

    def _forward_action(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        listeners = self.elbv2.describe_listeners(ListenerArns=[self.listener_arn])["Listeners"]
        if not listeners:
            raise ReleaseError(f"listener {self.listener_arn} not found")
        actions: list[dict[str, Any]] = listeners[0]["DefaultActions"]
        for action in actions:
            if action.get("Type") == "forward" and "ForwardConfig" in action:
                arns = {g["TargetGroupArn"] for g in action["ForwardConfig"]["TargetGroups"]}
                if set(self.target_groups.values()) <= arns:
                    return actions, action
        raise ReleaseError(
            f"listener {self.listener_arn} has no weighted forward action to both slot target groups "
            f"({', '.join(self.target_groups.values())}); is this the stack's listener?"
        )

    def weights(self) -> Weights:
        _, action = self._forward_action()
        by_arn = {g["TargetGroupArn"]: int(g.get("Weight", 1)) for g in action["ForwardConfig"]["TargetGroups"]}
        raw = {slot: by_arn.get(arn, 0) for slot, arn in self.target_groups.items()}
        total = sum(raw.values())
        if total == 0:
            raise ReleaseError(f"listener {self.listener_arn}: both target groups have weight 0")
        blue = round(100 * raw["blue"] / total)
        return {"blue": blue, "green": 100 - blue}

    def set_weights(self, weights: Weights) -> None:
        actions, action = self._forward_action()
        by_arn = {arn: weights[slot] for slot, arn in self.target_groups.items()}
        for group in action["ForwardConfig"]["TargetGroups"]:
            if group["TargetGroupArn"] in by_arn:
                group["Weight"] = by_arn[group["TargetGroupArn"]]
        # One call carries the whole split, so the listener never routes a half-applied state.
        self.elbv2.modify_listener(ListenerArn=self.listener_arn, DefaultActions=actions)

    def slot_status(self, slot: str) -> SlotStatus:
        arn = self.target_groups[slot]
        health = self.elbv2.describe_target_health(TargetGroupArn=arn)["TargetHealthDescriptions"]
        states: dict[str, int] = {}
        for target in health:
            state = target["TargetHealth"]["State"]
            states[state] = states.get(state, 0) + 1
        healthy = [t["Target"] for t in health if t["TargetHealth"]["State"] == "healthy"]
        counts = ", ".join(f"{n} {s}" for s, n in sorted(states.items())) or "no targets registered"
        detail = f"target group {arn.rsplit(':', 1)[-1]}: {counts}"
        return SlotStatus(ready=bool(healthy), detail=detail, endpoints=self._endpoints(healthy))

    def _endpoints(self, targets: Sequence[Mapping[str, Any]]) -> list[str]:
        """http://<private ip>:<port> of healthy targets: the slot reached directly, not through the ALB."""
        ips: dict[str, str] = {}
        instance_ids = [t["Id"] for t in targets if str(t["Id"]).startswith("i-")]
        if instance_ids and self.ec2 is not None:
            for reservation in self.ec2.describe_instances(InstanceIds=instance_ids)["Reservations"]:
                for instance in reservation["Instances"]:
                    if instance.get("PrivateIpAddress"):
                        ips[instance["InstanceId"]] = instance["PrivateIpAddress"]
        endpoints = []
        for target in targets:
            host = ips.get(target["Id"]) or (None if str(target["Id"]).startswith("i-") else target["Id"])
            port = target.get("Port") or self.server_port
            if host and port:
                endpoints.append(f"http://{host}:{port}")
        return endpoints


class CloudWatchAlarms:
    """The stack's CloudWatch alarms, by exact name."""

    def __init__(self, cloudwatch: Any, names: Sequence[str]) -> None:
        self.cloudwatch = cloudwatch
        self.names = list(names)

    def watched(self) -> list[str]:
        return list(self.names)

    def _describe(self) -> list[dict[str, Any]]:
        alarms: list[dict[str, Any]] = []
        for start in range(0, len(self.names), 100):  # DescribeAlarms takes at most 100 names
            page = self.cloudwatch.describe_alarms(AlarmNames=self.names[start : start + 100])
            alarms += page.get("MetricAlarms", []) + page.get("CompositeAlarms", [])
        return alarms

    def missing(self) -> list[str]:
        found = {a["AlarmName"] for a in self._describe()}
        return [name for name in self.names if name not in found]

    def firing(self) -> list[FiringAlarm]:
        return [FiringAlarm(a["AlarmName"], a.get("StateReason", ""))
                for a in self._describe() if a.get("StateValue") == "ALARM"]


def alarm_names(rules: Sequence[AlertRule], prefix: str) -> list[str]:
    """CloudWatch names of the stack's alarms: the alerting component names each ``<stack>-<RuleName>``."""
    return [f"{prefix}{rule.name}" for rule in rules]
