"""CloudWatch facts for the launch checks of an AWS stack: its alarms, their state and runbook links."""

from __future__ import annotations

from typing import Any

from infra.alerts import AlertRule


def alarm_name(stack: str, rule: AlertRule) -> str:
    """The CloudWatch alarm of ``rule`` in ``stack`` (infra/components/aws/alerting.py names it so)."""
    return f"{stack}-{rule.name}"


def stack_alarms(stack: str, region: str | None) -> dict[str, dict[str, Any]]:
    """Every metric alarm of the stack by name (boto3; AWS_ENDPOINT_URL selects another endpoint)."""
    import boto3

    pages = boto3.client("cloudwatch", region_name=region).get_paginator("describe_alarms").paginate(
        AlarmNamePrefix=f"{stack}-")
    return {alarm["AlarmName"]: alarm for page in pages for alarm in page["MetricAlarms"]}
