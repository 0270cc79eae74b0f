"""Alerting: the shared alert set as CloudWatch alarms, topics by severity, runbook links, dashboard."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pulumi
import pytest

from infra.alerts import alert_rules
from infra.components.aws.alerting import COMPARISONS, Alerting, AlertingArgs
from infra.config import PROJECT, load_stack
from infra.program.preview import PreviewResult, new_mocks
from serving import metric_names as m

StackFn = Callable[[str], PreviewResult]
STACKS = ("dev", "staging", "prod")
ALARM = "aws:cloudwatch/metricAlarm:MetricAlarm"


def _alarms(result: PreviewResult) -> dict[str, dict[str, Any]]:
    return {r.inputs["name"]: r.inputs for r in result.of_type(ALARM)}


def _rule_alarm(stack: str, result: PreviewResult, rule_name: str) -> dict[str, Any]:
    return _alarms(result)[_name(stack, rule_name)]


def _name(stack: str, rule_name: str) -> str:
    """The active slot's alarm of a rule."""
    return f"{stack}-{load_stack(stack).config.slots.active}-{rule_name}"


def _slots(stack: str) -> list[str]:
    return [s for s in ("blue", "green") if load_stack(stack).config.slots.slot(s) is not None]


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_one_alarm_per_rule_and_slot_named_after_them(stack: str, aws_stack: StackFn) -> None:
    expected = {f"{stack}-{slot}-{rule.name}" for rule in alert_rules(load_stack(stack).config)
                for slot in _slots(stack)}
    assert set(_alarms(aws_stack(stack))) == expected


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_thresholds_and_comparisons_are_the_rules(stack: str, aws_stack: StackFn) -> None:
    rules = alert_rules(load_stack(stack).config)
    alarms = _alarms(aws_stack(stack))
    assert all((alarms[_name(stack, r.name)]["threshold"], alarms[_name(stack, r.name)]["comparisonOperator"])
               == (r.threshold, COMPARISONS[r.comparison]) for r in rules)


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_each_alarm_must_hold_for_the_rules_duration(stack: str, aws_stack: StackFn) -> None:
    alarms = _alarms(aws_stack(stack))
    assert all(alarms[_name(stack, r.name)]["evaluationPeriods"] == r.for_minutes
               for r in alert_rules(load_stack(stack).config))


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_every_description_links_its_runbook(stack: str, aws_stack: StackFn) -> None:
    base = load_stack(stack).config.alerting.runbook_base_url
    alarms = _alarms(aws_stack(stack))
    assert all(f"{base}/{r.name}.md" in alarms[_name(stack, r.name)]["alarmDescription"]
               for r in alert_rules(load_stack(stack).config))


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_critical_alarms_notify_the_critical_topic(stack: str, aws_stack: StackFn) -> None:
    alarms = _alarms(aws_stack(stack))
    for rule in alert_rules(load_stack(stack).config):
        assert alarms[_name(stack, rule.name)]["alarmActions"] == [
            f"arn:aws:sns:us-east-1:123456789012:alerts-{rule.severity}"]


@pulumi.runtime.test
def test_error_rate_is_5xx_over_requests_from_the_load_balancer(aws_stack: StackFn) -> None:
    queries = _rule_alarm("prod", aws_stack("prod"), "SpecdeployHighErrorRate")["metricQueries"]
    signal = next(q for q in queries if q.get("returnData"))
    assert "target5xx" in signal["expression"] and "/ requests" in signal["expression"]


@pulumi.runtime.test
def test_p99_latency_reads_the_published_histogram(aws_stack: StackFn) -> None:
    stat = _rule_alarm("prod", aws_stack("prod"), "SpecdeployHighP99Latency")["metricQueries"][0]["metric"]
    assert (stat["metricName"], stat["stat"], stat["namespace"]) == (m.E2E, "p99", "Specdeploy")


@pulumi.runtime.test
def test_gpu_memory_alarm_divides_used_by_total(aws_stack: StackFn) -> None:
    queries = _rule_alarm("prod", aws_stack("prod"), "SpecdeployGpuMemoryHigh")["metricQueries"]
    assert {q["metric"]["metricName"] for q in queries if "metric" in q} == {m.GPU_MEMORY_USED, m.GPU_MEMORY_TOTAL}


@pulumi.runtime.test
def test_fleet_below_minimum_counts_missing_data_as_breaching(aws_stack: StackFn) -> None:
    alarm = _rule_alarm("prod", aws_stack("prod"), "SpecdeployFleetBelowMinimum")
    assert (alarm["treatMissingData"], alarm["threshold"]) == ("breaching", 2)


@pulumi.runtime.test
def test_pager_hears_only_critical(aws_stack: StackFn) -> None:
    https = [r.inputs["topic"] for r in aws_stack("prod").of_type("aws:sns/topicSubscription:TopicSubscription")
             if r.inputs["protocol"] == "https"]
    assert https == ["arn:aws:sns:us-east-1:123456789012:alerts-critical"]


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_dashboard_exists_per_stack(stack: str, aws_stack: StackFn) -> None:
    assert aws_stack(stack).single("aws:cloudwatch/dashboard:Dashboard").inputs["dashboardName"] == \
        f"specdeploy-{stack}"


def _args(**changes: Any) -> AlertingArgs:
    base: dict[str, Any] = {
        "stack": "unit", "region": "us-east-1", "rules": alert_rules(load_stack("dev").config),
        "runbook_base_url": "https://example.com/runbooks", "weights": {"blue": 100, "green": 0},
        "alb_arn_suffix": "app/lb/1",
        "target_group_arn_suffixes": {"blue": "targetgroup/b/1", "green": "targetgroup/g/1"},
        "asg_names": {"blue": "asg-blue"}, "emails": ["ops@example.com"],
    }
    return AlertingArgs(**{**base, **changes})


_built: dict[str, Alerting] = {}


@pulumi.runtime.test
def test_output_lists_every_alarm_name() -> pulumi.Output[None]:
    if "alerting" not in _built:
        pulumi.runtime.set_mocks(new_mocks(), project=PROJECT, stack="unit", preview=False)
        _built["alerting"] = Alerting("alerts", _args())

    def check(names: list[str]) -> None:
        assert sorted(names) == sorted(f"unit-blue-{r.name}" for r in alert_rules(load_stack("dev").config))

    assert sorted(_built["alerting"].alarm_names) == ["blue"]
    return _built["alerting"].alarm_names["blue"].apply(check)


def _two_slots(variant: Callable[..., PreviewResult], **release: Any) -> PreviewResult:
    current = load_stack("staging").config.slots.model_dump(mode="json", exclude_none=True)
    return variant("staging", release={**current, "green": current["blue"], **release})


@pulumi.runtime.test
def test_only_the_slots_carrying_traffic_page(aws_variant: Callable[..., PreviewResult]) -> None:
    alarms = _alarms(_two_slots(aws_variant, active="blue", canary_weight=0))
    assert {name for name, a in alarms.items() if a["actionsEnabled"]} == \
        {f"staging-blue-{r.name}" for r in alert_rules(load_stack("staging").config)}
    canary = _alarms(_two_slots(aws_variant, active="blue", canary_weight=10))
    assert all(a["actionsEnabled"] for a in canary.values())


@pulumi.runtime.test
def test_each_slots_alarms_read_that_slots_group_and_target_group(aws_variant: Callable[..., PreviewResult]) -> None:
    result = _two_slots(aws_variant)
    for slot in ("blue", "green"):
        alarm = _alarms(result)[f"staging-{slot}-SpecdeployFleetBelowMinimum"]
        dims = alarm["metricQueries"][0]["metric"]["dimensions"]
        assert dims["TargetGroup"] == f"targetgroup/lb-{slot}/0123456789abcdef"
        p99 = _alarms(result)[f"staging-{slot}-SpecdeployHighP99Latency"]["metricQueries"][0]["metric"]["dimensions"]
        assert p99["AutoScalingGroupName"] == f"fleet-{slot}-asg"


@pytest.mark.parametrize("stack", STACKS)
@pulumi.runtime.test
def test_release_commands_own_alarm_actions_after_creation(stack: str, aws_stack: StackFn) -> None:
    assert all("actionsEnabled" in r.ignore_changes for r in aws_stack(stack).of_type(ALARM))
