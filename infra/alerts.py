"""The alert set, defined once for every platform.

Each rule is rendered twice: as a CloudWatch alarm by the AWS alerting
component and as a PrometheusRule rule on Kubernetes. Names are the runbook
file names (``runbooks/<name>.md``); thresholds come from the stack's
``alerting`` section. The PromQL here reads only series the server exports
(``serving.metric_names``) plus kube-state-metrics for fleet-level rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from infra.config import StackConfig
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


def _quantile(metric: str, q: float, window: str = "5m") -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket[{window}])))"


def alert_rules(config: StackConfig) -> list[AlertRule]:
    """The alerts of one stack, thresholds filled in from its config."""
    a = config.alerting
    minutes = a.evaluation_minutes
    min_fleet = config.kubernetes.min_replicas if config.kubernetes else config.fleet.min_size
    return [
        AlertRule(
            name="SpecdeployHighErrorRate",
            severity="critical",
            summary="More than the allowed share of requests fail with a server error (5xx).",
            threshold=a.error_rate_critical,
            comparison=">",
            for_minutes=minutes,
            promql=(
                f'sum(rate({m.REQUESTS}_total{{status=~"5.."}}[5m])) / '
                f"clamp_min(sum(rate({m.REQUESTS}_total[5m])), 1e-9) > {a.error_rate_critical:g}"
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
            promql=f"{_quantile(m.E2E, 0.99)} > {a.p99_latency_s:g}",
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
            promql=f"{_quantile(m.TTFT, 0.99)} > {a.p99_ttft_s:g}",
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
            promql=f"max({m.WAITING}) > {a.queue_length_warn}",
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
                f"max({m.GPU_MEMORY_USED} / clamp_min({m.GPU_MEMORY_TOTAL}, 1)) >= {a.gpu_memory_warn_ratio:g}"
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
            promql=f"avg({m.GPU_UTILIZATION}) >= {a.gpu_utilization_high_ratio:g}",
            server_metrics=(m.GPU_UTILIZATION,),
        ),
        AlertRule(
            name="SpecdeployUnhealthyHosts",
            severity="critical",
            summary="Serving instances fail their readiness check.",
            threshold=0,
            comparison=">",
            for_minutes=2,
            promql=f"count({m.READY} == 0) > 0",
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
            promql=f"(count({m.READY} == 1) or vector(0)) < {min_fleet}",
            server_metrics=(m.READY,),
        ),
    ]

