"""The alert set, defined once for every platform.

Each rule is rendered twice: as a CloudWatch alarm by the AWS alerting
component and as a PrometheusRule rule on Kubernetes. Names are the runbook
file names (``runbooks/<name>.md``); thresholds come from the stack's
``alerting`` section. The PromQL here reads only series the server exports
(``serving.metric_names``) plus kube-state-metrics for fleet-level rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from infra.config import SLOTS, StackConfig
from serving import metric_names as m

Severity = Literal["warning", "critical"]
Comparison = Literal[">", ">=", "<"]


@dataclass(frozen=True)
class AlertRule:
    name: str  # CamelCase; also the runbook file name and the CloudWatch alarm name suffix
    severity: Severity
    summary: str  # one line, shown in the page
    threshold: float  # value the signal is compared with
    comparison: Comparison
    for_minutes: int  # how long the condition must hold
    promql: str  # full Prometheus expression including the comparison
    server_metrics: tuple[str, ...]  # server series the rule reads (cross-checked against /metrics)
    unit: str = ""

    def runbook_url(self, base_url: str) -> str:
        return f"{base_url.rstrip('/')}/{self.name}.md"

    def description(self, base_url: str) -> str:
        return f"{self.summary} Threshold {self.comparison} {self.threshold:g}{self.unit}. " \
               f"Runbook: {self.runbook_url(base_url)}"


@dataclass(frozen=True)
class _Scope:
    """Which series a rule reads and per what it fires.

    On Kubernetes the ServiceMonitor's targets carry ``namespace`` (the Prometheus Operator
    sets it from the scraped Service) and ``slot`` (relabelled from the Service's
    ``specdeploy.dev/slot`` label, ``infra/components/kubernetes/observability.py``): every
    rule selects the stack's namespace and aggregates per slot, so another namespace's
    servers never enter the ratio and one slot's errors are not diluted by the other's
    traffic. Elsewhere (one fleet, no such labels) the expressions are unscoped.
    """

    matchers: tuple[str, ...] = ()
    group: tuple[str, ...] = ()

    def select(self, metric: str, *extra: str) -> str:
        matchers = (*self.matchers, *extra)
        return f"{metric}{{{','.join(matchers)}}}" if matchers else metric

    def by(self, *labels: str) -> str:
        grouping = (*self.group, *labels)
        return f" by ({', '.join(grouping)}) " if grouping else ""


# Kubernetes: percent of requests each slot gets, as recorded in the PrometheusRule `specdeploy-traffic`, which
# `specdeploy rollout|rollback` rewrite at every shift (as they switch CloudWatch alarm actions on AWS). Every
# slot-level alert fires only for slots with traffic, so paging follows the live split without a `pulumi up`.
TRAFFIC_RECORD = "specdeploy:slot_traffic_percent"
TRAFFIC_RULE_NAME = "specdeploy-traffic"


def traffic_rule_groups(namespace: str, weights: Mapping[str, int]) -> list[dict[str, Any]]:
    """The `specdeploy-traffic` PrometheusRule's groups: one constant series per slot, labelled namespace and slot."""
    rules = [{"record": TRAFFIC_RECORD, "expr": f"vector({int(weights.get(slot, 0))})",
              "labels": {"namespace": namespace, "slot": slot}} for slot in SLOTS]
    return [{"name": "specdeploy-traffic", "rules": rules}]


def _scope(config: StackConfig) -> _Scope:
    if config.kubernetes is None:
        return _Scope()
    return _Scope(matchers=(f'namespace="{config.kubernetes.namespace}"',), group=("slot",))


def _fleet_below_minimum(scope: _Scope, minimum: int, per_slot: bool) -> str:
    """Ready servers below the minimum. Kubernetes: per slot carrying traffic, a slot with no ready pod
    counting 0 (its traffic series supplies the slot), so neither an idle slot's pods hide a dead live slot
    nor does an idle slot at its floor page."""
    ready = f"count{scope.by()}({scope.select(m.READY)} == 1)"
    if not per_slot:
        return f"({ready} or vector(0)) < {minimum}"
    traffic = scope.select(TRAFFIC_RECORD)
    # `sum by (slot)`: the zero of a slot with no ready pod carries the same labels as a count (no namespace)
    return f"({ready} or on(slot) (sum by (slot) ({traffic}) * 0)) < {minimum} and on(slot) ({traffic} > 0)"


def _quantile(scope: _Scope, metric: str, q: float, window: str = "5m") -> str:
    return f"histogram_quantile({q}, sum{scope.by('le')}(rate({scope.select(metric + '_bucket')}[{window}])))"


def alert_rules(config: StackConfig) -> list[AlertRule]:
    """The alerts of one stack, thresholds filled in from its config."""
    a = config.alerting
    minutes = a.evaluation_minutes
    min_fleet = config.kubernetes.min_replicas if config.kubernetes else config.fleet.min_size
    scope = _scope(config)
    # Kubernetes: a slot-level alert fires for slots carrying traffic only (the live split, kept by the
    # release commands in the `specdeploy-traffic` rule); elsewhere one fleet, nothing to join.
    live = f" and on(slot) ({scope.select(TRAFFIC_RECORD)} > 0)" if config.kubernetes else ""
    requests = scope.select(f"{m.REQUESTS}_total")
    errors = scope.select(f"{m.REQUESTS}_total", 'status=~"5.."')
    return [
        AlertRule(
            name="SpecdeployHighErrorRate",
            severity="critical",
            summary="More than the allowed share of requests fail with a server error (5xx).",
            threshold=a.error_rate_critical,
            comparison=">",
            for_minutes=minutes,
            promql=(
                f"sum{scope.by()}(rate({errors}[5m])) / "
                f"clamp_min(sum{scope.by()}(rate({requests}[5m])), 1e-9) > {a.error_rate_critical:g}{live}"
            ),
            server_metrics=(f"{m.REQUESTS}_total",),
            unit="",
        ),
        AlertRule(
            name="SpecdeployHighP99Latency",
            severity="warning",
            summary="P99 end-to-end request latency is above the threshold.",
            threshold=a.p99_latency_s,
            comparison=">",
            for_minutes=minutes,
            promql=f"{_quantile(scope, m.E2E, 0.99)} > {a.p99_latency_s:g}{live}",
            server_metrics=(f"{m.E2E}_bucket",),
            unit="s",
        ),
        AlertRule(
            name="SpecdeployHighP99Ttft",
            severity="warning",
            summary="P99 time to first token is above the threshold.",
            threshold=a.p99_ttft_s,
            comparison=">",
            for_minutes=minutes,
            promql=f"{_quantile(scope, m.TTFT, 0.99)} > {a.p99_ttft_s:g}{live}",
            server_metrics=(f"{m.TTFT}_bucket",),
            unit="s",
        ),
        AlertRule(
            name="SpecdeployQueueBacklog",
            severity="warning",
            summary="Requests are waiting for a batch slot on an instance (capacity short).",
            threshold=float(a.queue_length_warn),
            comparison=">",
            for_minutes=minutes,
            promql=f"max{scope.by()}({scope.select(m.WAITING)}) > {a.queue_length_warn}{live}",
            server_metrics=(m.WAITING,),
        ),
        AlertRule(
            name="SpecdeployGpuMemoryHigh",
            severity="warning",
            summary="GPU memory use is at the guide's warning level.",
            threshold=a.gpu_memory_warn_ratio,
            comparison=">=",
            for_minutes=minutes,
            promql=(
                f"max{scope.by()}({scope.select(m.GPU_MEMORY_USED)} / clamp_min({scope.select(m.GPU_MEMORY_TOTAL)}, 1))"
                f" >= {a.gpu_memory_warn_ratio:g}{live}"
            ),
            server_metrics=(m.GPU_MEMORY_USED, m.GPU_MEMORY_TOTAL),
        ),
        AlertRule(
            name="SpecdeployGpuUtilizationHigh",
            severity="warning",
            summary="GPUs are saturated; latency will grow with load.",
            threshold=a.gpu_utilization_high_ratio,
            comparison=">=",
            for_minutes=max(minutes, 15),
            promql=f"avg{scope.by()}({scope.select(m.GPU_UTILIZATION)}) >= {a.gpu_utilization_high_ratio:g}{live}",
            server_metrics=(m.GPU_UTILIZATION,),
        ),
        AlertRule(
            name="SpecdeployUnhealthyHosts",
            severity="critical",
            summary="Serving instances fail their readiness check.",
            threshold=0,
            comparison=">",
            for_minutes=2,
            promql=f"count{scope.by()}({scope.select(m.READY)} == 0) > 0{live}",
            server_metrics=(m.READY,),
        ),
        AlertRule(
            name="SpecdeployFleetBelowMinimum",
            severity="critical",
            summary="Fewer serving instances are in service than the configured baseline.",
            threshold=float(min_fleet),
            comparison="<",
            for_minutes=5,
            # `or vector(0)`: with every instance gone there is no series left to count.
            promql=_fleet_below_minimum(scope, min_fleet, config.kubernetes is not None),
            server_metrics=(m.READY,),
        ),
    ]

