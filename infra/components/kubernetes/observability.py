"""Alerts, scraping and the dashboard for the Prometheus Operator (kube-prometheus-stack).

The PrometheusRule renders ``infra.alerts.alert_rules`` — the same alert set the AWS
platform renders as CloudWatch alarms — with each alert's ``runbook_url``. The
ServiceMonitor scrapes every slot's Service and labels series with ``slot`` (the
Prometheus Operator adds ``namespace``); the rules select the stack's namespace and
fire per slot, ``SpecdeployFleetBelowMinimum`` on the active slot alone; the
dashboard ConfigMap carries the label Grafana's sidecar discovers dashboards by.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra.alerts import TRAFFIC_RULE_NAME, AlertRule, traffic_rule_groups
from infra.components.kubernetes.common import (
    HTTP_PORT_NAME,
    METRICS_KEY_SECRET_KEY,
    SLOT_LABEL,
    app_labels,
    server_selector,
)
from infra.components.kubernetes.dashboard import serving_dashboard

MONITORING_API = "monitoring.coreos.com/v1"
DASHBOARD_FILE = "specdeploy-serving.json"
SCRAPE_INTERVAL = "15s"


@dataclass(frozen=True)
class ServingObservabilityArgs:
    namespace: pulumi.Input[str]  # where the rule, monitor and dashboard go
    server_namespace: str  # the namespace whose Services the ServiceMonitor scrapes (kubernetes.namespace)
    rules: list[AlertRule]  # infra.alerts.alert_rules of the stack
    runbook_base_url: str
    prometheus_release: str  # kube-prometheus-stack's Helm release: its rule and monitor selector
    metrics_key_secret: str | None  # Secret with the scrape key when /metrics needs auth; None: open
    traffic_weights: dict[str, int]  # percent per slot when first created (release.weights())


def prometheus_rule(rule: AlertRule, runbook_base_url: str) -> dict[str, Any]:
    """One alerting rule of the PrometheusRule, from the shared alert definition."""
    return {
        "alert": rule.name,
        "expr": rule.promql,
        "for": f"{rule.for_minutes}m",
        "labels": {"severity": rule.severity, "service": "specdeploy"},
        "annotations": {
            "summary": rule.summary,
            "description": rule.description(runbook_base_url),
            "runbook_url": rule.runbook_url(runbook_base_url),
        },
    }


def _slot_relabeling() -> dict[str, Any]:
    source = "__meta_kubernetes_service_label_" + "".join(c if c.isalnum() else "_" for c in SLOT_LABEL)
    return {"action": "replace", "sourceLabels": [source], "targetLabel": "slot"}


class ServingObservability(pulumi.ComponentResource):
    """PrometheusRule, ServiceMonitor and the Grafana dashboard ConfigMap."""

    rule: k8s.apiextensions.CustomResource
    traffic: k8s.apiextensions.CustomResource
    service_monitor: k8s.apiextensions.CustomResource
    dashboard: k8s.core.v1.ConfigMap
    alert_names: list[str]

    def __init__(self, name: str, args: ServingObservabilityArgs,
                 opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("specdeploy:kubernetes:ServingObservability", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        # kube-prometheus-stack selects rules and monitors by its Helm release label.
        selected = {**app_labels("monitoring"), "release": args.prometheus_release}

        rules = [prometheus_rule(rule, args.runbook_base_url) for rule in args.rules]
        self.rule = k8s.apiextensions.CustomResource(
            f"{name}-rules",
            api_version=MONITORING_API,
            kind="PrometheusRule",
            metadata={"name": "specdeploy-alerts", "namespace": args.namespace, "labels": selected},
            spec={"groups": [{"name": "specdeploy", "rules": rules}]},
            opts=child,
        )

        # The live traffic split the alerts join on (infra/alerts.py TRAFFIC_RECORD): created from the stack file,
        # then rewritten by `specdeploy rollout|rollback` at every shift; `pulumi up` leaves its rules alone.
        self.traffic = k8s.apiextensions.CustomResource(
            f"{name}-traffic",
            api_version=MONITORING_API,
            kind="PrometheusRule",
            metadata={"name": TRAFFIC_RULE_NAME, "namespace": args.namespace, "labels": selected},
            spec={"groups": traffic_rule_groups(args.server_namespace, args.traffic_weights)},
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=["spec"]),
        )

        endpoint: dict[str, Any] = {
            "port": HTTP_PORT_NAME,
            "path": "/metrics",
            "interval": SCRAPE_INTERVAL,
            "scrapeTimeout": "10s",
            "relabelings": [_slot_relabeling()],
        }
        if args.metrics_key_secret is not None:
            # A key that is also listed in the api-keys file; Prometheus reads it from the same Secret.
            endpoint["authorization"] = {
                "type": "Bearer",
                "credentials": {"name": args.metrics_key_secret, "key": METRICS_KEY_SECRET_KEY},
            }
        self.service_monitor = k8s.apiextensions.CustomResource(
            f"{name}-service-monitor",
            api_version=MONITORING_API,
            kind="ServiceMonitor",
            metadata={"name": "specdeploy", "namespace": args.namespace, "labels": selected},
            spec={
                "selector": {"matchLabels": server_selector()},
                "namespaceSelector": {"matchNames": [args.server_namespace]},
                "endpoints": [endpoint],
            },
            opts=child,
        )

        self.dashboard = k8s.core.v1.ConfigMap(
            f"{name}-dashboard",
            metadata={
                "name": "specdeploy-dashboard",
                "namespace": args.namespace,
                # The Grafana sidecar of kube-prometheus-stack loads ConfigMaps with this label.
                "labels": {**app_labels("monitoring"), "grafana_dashboard": "1"},
                "annotations": {"grafana_folder": "specdeploy"},
            },
            data={DASHBOARD_FILE: json.dumps(serving_dashboard(), indent=1, sort_keys=True)},
            opts=child,
        )

        self.alert_names = [rule["alert"] for rule in rules]
        self.register_outputs({"alert_names": self.alert_names})
