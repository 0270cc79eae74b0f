"""One alert set, two renderings: CloudWatch alarms (aws prod) and PrometheusRule rules (k8s-prod).

The two production stacks share their `alerting` section and their baseline size, so
every alert must carry the same name, comparison and threshold on both platforms.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from infra.alerts import TRAFFIC_RECORD
from infra.config import load_stack
from infra.ops.k8s_render import render_objects
from infra.program.preview import record_stack

CLOUDWATCH = {"GreaterThanThreshold": ">", "GreaterThanOrEqualToThreshold": ">=", "LessThanThreshold": "<"}


@pytest.fixture(scope="module")
def aws_alarms() -> dict[str, tuple[str, float]]:
    alarms = record_stack("prod").of_type("aws:cloudwatch/metricAlarm:MetricAlarm")
    # CloudWatch names each slot's alarm prod-<slot>-<Rule>; prod defines blue alone
    return {a.inputs["name"].removeprefix("prod-blue-"): (CLOUDWATCH[a.inputs["comparisonOperator"]],
                                                          float(a.inputs["threshold"])) for a in alarms}


@pytest.fixture(scope="module")
def k8s_rules() -> dict[str, tuple[str, float]]:
    objects = render_objects((r.type, r.inputs) for r in record_stack("k8s-prod").resources)
    [rule_object] = [o for o in objects
                     if o["kind"] == "PrometheusRule" and o["metadata"]["name"] == "specdeploy-alerts"]
    rules: list[dict[str, Any]] = rule_object["spec"]["groups"][0]["rules"]
    parsed = {}
    for rule in rules:
        # the comparison, before the join that limits the alert to slots carrying traffic
        expr = rule["expr"].split(f" and on(slot) ({TRAFFIC_RECORD}")[0]
        match = re.search(r"(>=|>|<)\s*([0-9.e+-]+)$", expr)
        assert match, rule["expr"]
        parsed[rule["alert"]] = (match[1], float(match[2]))
    return parsed


def test_the_two_production_stacks_share_their_alerting_settings() -> None:
    aws, k8s = load_stack("prod").config, load_stack("k8s-prod").config
    assert aws.alerting == k8s.alerting
    assert k8s.kubernetes is not None and aws.fleet.min_size == k8s.kubernetes.min_replicas


def test_alert_names_are_the_same_on_both_platforms(aws_alarms: dict[str, Any], k8s_rules: dict[str, Any]) -> None:
    assert sorted(aws_alarms) == sorted(k8s_rules)


def test_alert_thresholds_and_comparisons_are_the_same_on_both_platforms(aws_alarms: dict[str, Any],
                                                                        k8s_rules: dict[str, Any]) -> None:
    assert aws_alarms == k8s_rules
