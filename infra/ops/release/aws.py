"""AWS: the ALB listener's weighted forward action, target health, CloudWatch alarms.

The load balancer component (``infra/components/aws/load_balancer.py``) creates one
listener whose default action forwards to the blue and green target groups by
weight. A shift rewrites that action's weights in one ``ModifyListener`` call and
keeps everything else in it (stickiness, the order of the groups) as it was.

The release tooling reaches one slot alone through that slot's listener on the same load
balancer (stack output ``gate_endpoints``): the fleet's security group admits the
server port from the load balancer only, so the instances' private addresses are
never probed. Each slot has its own alarms (``<stack>-<slot>-<Rule>``); after every
shift the slots carrying traffic get their alarm actions enabled, a slot at 0 %
disabled, so paging follows traffic without a ``pulumi up``.
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
    def __init__(self, elbv2: Any, listener_arn: str, target_groups: Mapping[str, str],
                 slot_endpoints: Mapping[str, str] | None = None) -> None:
        missing = [slot for slot in SLOTS if not target_groups.get(slot)]
        if missing:
            raise ReleaseError(f"no target group ARN for slot(s) {', '.join(missing)}")
        self.elbv2 = elbv2
        self.listener_arn = listener_arn
        self.target_groups = dict(target_groups)
        self.slot_endpoints = {slot: url.rstrip("/") for slot, url in (slot_endpoints or {}).items() if url}
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
        direct = self.slot_endpoints.get(slot)
        # The slot's listener, never the targets' private addresses (only the ALB may reach those).
        return SlotStatus(ready=bool(healthy), detail=detail, endpoints=[direct] if direct else [])


class CloudWatchAlarms:
    """The stack's CloudWatch alarms, by exact name; ``by_slot`` says which slot each one watches."""

    def __init__(self, cloudwatch: Any, names: Sequence[str],
                 by_slot: Mapping[str, Sequence[str]] | None = None) -> None:
        self.cloudwatch = cloudwatch
        self.by_slot = {slot: list(listed) for slot, listed in (by_slot or {}).items() if slot in SLOTS}
        self.names = list(dict.fromkeys([*names, *(n for listed in self.by_slot.values() for n in listed)]))

    def follow(self, weights: Weights) -> dict[str, bool]:
        """Alarm actions on for the slots with traffic, off for a slot at 0 %; returns slot -> enabled."""
        changed: dict[str, bool] = {}
        for slot, names in sorted(self.by_slot.items()):
            if not names:
                continue
            on = weights.get(slot, 0) > 0
            for start in range(0, len(names), 100):  # the API takes at most 100 names a call
                batch = names[start : start + 100]
                if on:
                    self.cloudwatch.enable_alarm_actions(AlarmNames=batch)
                else:
                    self.cloudwatch.disable_alarm_actions(AlarmNames=batch)
            changed[slot] = on
        return changed

    def actions_enabled(self) -> dict[str, bool]:
        """slot -> whether all of its alarms page (a mix reads as False)."""
        enabled = {a["AlarmName"]: bool(a.get("ActionsEnabled")) for a in self._describe()}
        return {slot: all(enabled.get(n, False) for n in names) for slot, names in self.by_slot.items() if names}

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


def alarm_names(rules: Sequence[AlertRule], prefix: str, slots: Sequence[str] = SLOTS) -> dict[str, list[str]]:
    """CloudWatch names of the stack's alarms by slot: the alerting component names each
    ``<stack>-<slot>-<RuleName>`` (``prefix`` is ``<stack>-``)."""
    return {slot: [f"{prefix}{slot}-{rule.name}" for rule in rules] for slot in slots}
