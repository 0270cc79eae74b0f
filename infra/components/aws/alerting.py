"""Alerting: SNS topics, the shared alert set as CloudWatch alarms, and a dashboard.

The rules come from infra/alerts.py (the same set the Kubernetes platform renders as a
PrometheusRule): each becomes one alarm per slot named `<stack>-<slot>-<RuleName>` over
that slot's autoscaling group and target group, with the rule's threshold, comparison
and duration, a description linking `runbooks/<RuleName>.md`, and actions on the topic
of its severity. Critical alarms go to every subscriber (the pager's HTTPS endpoint
included); warnings go to email.

Alarms follow traffic without a `pulumi up`: the alarms of a slot carrying traffic
have their actions enabled, those of a slot at weight 0 disabled. Pulumi sets that at
creation from the stack file's release; afterwards `specdeploy rollout|rollback` own
it (EnableAlarmActions/DisableAlarmActions next to each listener change), so
`actions_enabled` is in ignore_changes like the listener's weights.

Signals: request, error and host counts from the load balancer (AWS/ApplicationELB);
queue, GPU and readiness gauges published by the CloudWatch agent from the server's
/metrics; p99 latency and TTFT from the histogram publisher's value/count sets
(namespace `Specdeploy`, dimension AutoScalingGroupName of the alarm's slot).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, cast

import pulumi
import pulumi_aws as aws

from infra.alerts import AlertRule
from infra.components.aws.common import ASG_DIMENSION, METRIC_NAMESPACE, child, tags
from serving import metric_names as m

COMPARISONS = {">": "GreaterThanThreshold", ">=": "GreaterThanOrEqualToThreshold", "<": "LessThanThreshold"}
ELB = "AWS/ApplicationELB"
PERIOD_S = 60


@dataclass(frozen=True)
class AlertingArgs:
    stack: str
    region: str
    rules: list[AlertRule]
    runbook_base_url: str
    weights: dict[str, int]  # slot -> percent of traffic the stack file records (alarm actions at creation)
    alb_arn_suffix: pulumi.Input[str]
    target_group_arn_suffixes: dict[str, pulumi.Input[str]]  # slot -> target group suffix
    asg_names: dict[str, pulumi.Input[str]]  # slot -> autoscaling group (defined slots only)
    emails: list[str] = field(default_factory=list)
    https_endpoints: list[str] = field(default_factory=list)
    actions_enabled: bool = True  # off while bootstrapping: a fleet at zero is expected, not an incident

    def __post_init__(self) -> None:
        without_fleet = sorted(slot for slot, weight in self.weights.items()
                               if weight > 0 and slot not in self.asg_names)
        if without_fleet:
            raise ValueError(f"release: slot(s) {', '.join(without_fleet)} carry traffic but have no fleet")
        known = {"SpecdeployHighErrorRate", "SpecdeployHighP99Latency", "SpecdeployHighP99Ttft",
                 "SpecdeployQueueBacklog", "SpecdeployGpuMemoryHigh", "SpecdeployGpuUtilizationHigh",
                 "SpecdeployUnhealthyHosts", "SpecdeployFleetBelowMinimum"}
        unknown = sorted({rule.name for rule in self.rules} - known)
        if unknown:
            raise ValueError(f"no CloudWatch rendering for alert rule(s) {', '.join(unknown)} (infra/alerts.py)")


def _metric(namespace: str, name: str, dimensions: dict[str, Any], stat: str) -> dict[str, Any]:
    return {"metric": {"namespace": namespace, "metric_name": name, "dimensions": dimensions, "period": PERIOD_S,
                       "stat": stat}}


def alarm_name(stack: str, slot: str, rule: str) -> str:
    return f"{stack}-{slot}-{rule}"


def _queries(rule: AlertRule, args: AlertingArgs, slot: str) -> tuple[list[dict[str, Any]], str]:
    """Metric queries of one slot's alarm (the last one returns data) and how missing data counts."""
    asg = {ASG_DIMENSION: args.asg_names[slot]}
    lb = {"LoadBalancer": args.alb_arn_suffix}
    tg = {**lb, "TargetGroup": args.target_group_arn_suffixes[slot]}

    def single(name: str, stat: str, dims: dict[str, Any] = asg,
               namespace: str = METRIC_NAMESPACE) -> list[dict[str, Any]]:
        return [{"id": "signal", "return_data": True, **_metric(namespace, name, dims, stat)}]

    if rule.name == "SpecdeployHighErrorRate":
        # The slot's own requests and 5xx (target group dimension); the load balancer's own 502/503/504 have no
        # target group, so they count against the whole load balancer's requests in every slot's alarm.
        return [
            {"id": "requests", "return_data": False, **_metric(ELB, "RequestCount", tg, "Sum")},
            {"id": "target5xx", "return_data": False, **_metric(ELB, "HTTPCode_Target_5XX_Count", tg, "Sum")},
            {"id": "lbrequests", "return_data": False, **_metric(ELB, "RequestCount", lb, "Sum")},
            {"id": "elb5xx", "return_data": False, **_metric(ELB, "HTTPCode_ELB_5XX_Count", lb, "Sum")},
            {"id": "signal", "return_data": True, "label": "5xx share of requests",
             "expression": "MAX([IF(FILL(requests, 0) > 0, FILL(target5xx, 0) / requests, 0), "
                           "IF(FILL(lbrequests, 0) > 0, FILL(elb5xx, 0) / lbrequests, 0)])"},
        ], "notBreaching"
    if rule.name == "SpecdeployHighP99Latency":
        return single(m.E2E, "p99"), "notBreaching"
    if rule.name == "SpecdeployHighP99Ttft":
        return single(m.TTFT, "p99"), "notBreaching"
    if rule.name == "SpecdeployQueueBacklog":
        return single(m.WAITING, "Maximum"), "notBreaching"
    if rule.name == "SpecdeployGpuUtilizationHigh":
        return single(m.GPU_UTILIZATION, "Average"), "notBreaching"
    if rule.name == "SpecdeployGpuMemoryHigh":
        return [
            {"id": "used", "return_data": False, **_metric(METRIC_NAMESPACE, m.GPU_MEMORY_USED, asg, "Maximum")},
            {"id": "total", "return_data": False, **_metric(METRIC_NAMESPACE, m.GPU_MEMORY_TOTAL, asg, "Maximum")},
            {"id": "signal", "return_data": True, "label": "GPU memory used share", "expression": "used / total"},
        ], "notBreaching"
    if rule.name == "SpecdeployUnhealthyHosts":
        return single("UnHealthyHostCount", "Maximum", tg, ELB), "notBreaching"
    # SpecdeployFleetBelowMinimum: targets of the slot passing /ready; no data means none.
    return single("HealthyHostCount", "Minimum", tg, ELB), "breaching"


class Alerting(pulumi.ComponentResource):
    alarm_names: dict[str, pulumi.Output[list[str]]]  # slot -> its alarms
    alarm_arns: pulumi.Output[list[str]]  # every alarm of every slot
    topic_arns: dict[str, pulumi.Output[str]]
    dashboard_name: pulumi.Output[str]

    def __init__(self, name: str, args: AlertingArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("specdeploy:aws:Alerting", name, None, opts)
        topics = {severity: self._topic(name, severity, args) for severity in ("critical", "warning")}
        alarms = {slot: [self._alarm(name, rule, args, slot, topics[rule.severity]) for rule in args.rules]
                  for slot in sorted(args.asg_names)}
        dashboard = self._dashboard(name, args)
        self.alarm_names = {slot: pulumi.Output.all(*[alarm.name for alarm in made]) for slot, made in alarms.items()}
        self.alarm_arns = pulumi.Output.all(*[alarm.arn for made in alarms.values() for alarm in made])
        self.topic_arns = {severity: topic.arn for severity, topic in topics.items()}
        self.dashboard_name = dashboard.dashboard_name
        self.register_outputs({"alarm_names": self.alarm_names, "topic_arns": self.topic_arns,
                               "dashboard_name": self.dashboard_name})

    def _topic(self, name: str, severity: str, args: AlertingArgs) -> aws.sns.Topic:
        topic = aws.sns.Topic(f"{name}-{severity}", name=f"specdeploy-{args.stack}-{severity}",
                              tags=tags(f"{name}-{severity}", severity=severity), opts=child(self))
        endpoints = [("email", address) for address in args.emails]
        if severity == "critical":
            endpoints += [("https", url) for url in args.https_endpoints]  # the pager hears critical only
        for index, (protocol, endpoint) in enumerate(endpoints):
            aws.sns.TopicSubscription(f"{name}-{severity}-{protocol}-{index}", topic=topic.arn, protocol=protocol,
                                      endpoint=endpoint, opts=child(self))
        return topic

    def _alarm(self, name: str, rule: AlertRule, args: AlertingArgs, slot: str,
               topic: aws.sns.Topic) -> aws.cloudwatch.MetricAlarm:
        queries, missing = _queries(rule, args, slot)
        full_name = alarm_name(args.stack, slot, rule.name)
        return aws.cloudwatch.MetricAlarm(
            f"{name}-{slot}-{rule.name}",
            name=full_name,
            alarm_description=rule.description(args.runbook_base_url),
            comparison_operator=COMPARISONS[rule.comparison],
            threshold=rule.threshold,
            evaluation_periods=rule.for_minutes,
            datapoints_to_alarm=rule.for_minutes,
            metric_queries=cast(list[aws.cloudwatch.MetricAlarmMetricQueryArgsDict], queries),
            treat_missing_data=missing,
            # A slot at weight 0 pages nobody; the release commands flip this as traffic moves (see above).
            actions_enabled=args.actions_enabled and args.weights.get(slot, 0) > 0,
            alarm_actions=[topic.arn],
            ok_actions=[topic.arn],
            tags=tags(full_name, severity=rule.severity, slot=slot, runbook=rule.runbook_url(args.runbook_base_url)),
            opts=child(self, ignore_changes=["actionsEnabled"]),
        )

    def _dashboard(self, name: str, args: AlertingArgs) -> aws.cloudwatch.Dashboard:
        slots = sorted(args.asg_names)

        def body(values: list[Any]) -> str:
            lb, *rest = values
            asgs = dict(zip(slots, rest, strict=True))

            def per_slot(metric: str, stat: str) -> list[list[Any]]:
                return [[METRIC_NAMESPACE, metric, ASG_DIMENSION, asgs[s], {"stat": stat, "label": s}] for s in slots]

            def widget(title: str, metrics: list[list[Any]], x: int, y: int) -> dict[str, Any]:
                return {"type": "metric", "x": x, "y": y, "width": 12, "height": 6,
                        "properties": {"title": title, "region": args.region, "period": PERIOD_S, "view": "timeSeries",
                                       "metrics": metrics}}

            widgets = [
                widget("Requests and 5xx", [[ELB, "RequestCount", "LoadBalancer", lb, {"stat": "Sum"}],
                                            [ELB, "HTTPCode_Target_5XX_Count", "LoadBalancer", lb, {"stat": "Sum"}]],
                       0, 0),
                widget("P99 end-to-end latency (s)", per_slot(m.E2E, "p99"), 12, 0),
                widget("P99 time to first token (s)", per_slot(m.TTFT, "p99"), 0, 6),
                widget("Waiting requests per instance", per_slot(m.WAITING, "Average"), 12, 6),
                widget("GPU utilisation (%)", per_slot("nvidia_smi_utilization_gpu", "Average"), 0, 12),
                widget("GPU memory used (MiB)", per_slot("nvidia_smi_memory_used", "Maximum"), 12, 12),
            ]
            return json.dumps({"widgets": widgets}, sort_keys=True)

        return aws.cloudwatch.Dashboard(
            f"{name}-dashboard",
            dashboard_name=f"specdeploy-{args.stack}",
            dashboard_body=pulumi.Output.all(args.alb_arn_suffix, *[args.asg_names[s] for s in slots]).apply(body),
            opts=child(self),
        )
