"""PrometheusRule from the shared alert set, ServiceMonitor, Grafana dashboard ConfigMap."""

from __future__ import annotations

import json
import re
from typing import Any

import pulumi
import pytest

from infra.alerts import alert_rules
from infra.components.kubernetes.dashboard import serving_dashboard
from infra.config import load_stack

PROD = load_stack("k8s-prod").config
RULES = alert_rules(PROD)
# The k8s-prod rules written out by hand (stacks/Pulumi.k8s-prod.yaml's alerting section and
# kubernetes.min_replicas), not computed by alert_rules(): name -> (severity, for, PromQL).
_K8S_PROD_RULES = {
    "SpecdeployHighErrorRate": ("critical", "5m",
                                'sum by (slot) (rate(specdeploy_requests_total{@,status=~"5.."}[5m]))'
                                ' / clamp_min(sum by (slot) (rate(specdeploy_requests_total{@}[5m])),'
                                " 1e-9) > 0.01 LIVE"),
    "SpecdeployHighP99Latency": ("warning", "5m", "histogram_quantile(0.99, sum by (slot, le) (rate("
                                 'specdeploy_e2e_request_latency_seconds_bucket{@}[5m]))) > 30 LIVE'),
    "SpecdeployHighP99Ttft": ("warning", "5m", "histogram_quantile(0.99, sum by (slot, le) (rate("
                              'specdeploy_time_to_first_token_seconds_bucket{@}[5m]))) > 1.5 LIVE'),
    "SpecdeployQueueBacklog": ("warning", "5m", 'max by (slot) (specdeploy_requests_waiting{@}) > 32 LIVE'),
    "SpecdeployGpuMemoryHigh": ("warning", "5m", 'max by (slot) (specdeploy_gpu_memory_used_bytes{@}'
                                ' / clamp_min(specdeploy_gpu_memory_total_bytes{@}, 1)) >= 0.85 LIVE'),
    "SpecdeployGpuUtilizationHigh": ("warning", "15m",
                                     'avg by (slot) (specdeploy_gpu_utilization_ratio{@}) >= 0.95 LIVE'),
    "SpecdeployUnhealthyHosts": ("critical", "2m", 'count by (slot) (specdeploy_ready{@} == 0) > 0 LIVE'),
    # Per slot carrying traffic (the release commands keep specdeploy-traffic's split): a slot with none of its
    # pods ready counts 0 through its traffic series, and an idle slot's pods neither count nor page.
    "SpecdeployFleetBelowMinimum": ("critical", "5m",
                                    "(count by (slot) (specdeploy_ready{@} == 1) or on(slot) "
                                    "(sum by (slot) (specdeploy:slot_traffic_percent{@}) * 0)) < 2 LIVE"),
}
# `@` stands for the namespace matcher every selection carries; LIVE for the join on the live traffic split.
K8S_PROD_RULES = {name: (severity, duration, expr.replace(" LIVE", " and on(slot) "
                                                           "(specdeploy:slot_traffic_percent{@} > 0)")
                         .replace("@", 'namespace="specdeploy"'))
                  for name, (severity, duration, expr) in _K8S_PROD_RULES.items()}
EXPECTED_PANELS = {"Time to first token", "Time per output token", "Throughput", "Queue", "KV cache usage",
                   "Speculative acceptance rate", "Errors"}


def _rules(prod: Any) -> pulumi.Output[list[dict[str, Any]]]:
    return prod().stack.observability.rule.spec.apply(lambda spec: spec["groups"][0]["rules"])


def dashboard_queries() -> list[str]:
    dashboard = serving_dashboard()
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return queries


@pulumi.runtime.test
def test_rule_names_are_the_alert_set_in_order(prod: Any) -> pulumi.Output[None]:
    def check(rules: list[dict[str, Any]]) -> None:
        assert [r["alert"] for r in rules] == list(K8S_PROD_RULES)
    return _rules(prod).apply(check)


@pulumi.runtime.test
def test_rule_expressions_and_durations_are_written_for_k8s_prod(prod: Any) -> pulumi.Output[None]:
    def check(rules: list[dict[str, Any]]) -> None:
        assert {r["alert"]: (r["expr"], r["for"]) for r in rules} == {
            name: (expr, duration) for name, (_, duration, expr) in K8S_PROD_RULES.items()}
    return _rules(prod).apply(check)


@pulumi.runtime.test
def test_rule_thresholds_come_from_the_stack(prod: Any) -> pulumi.Output[None]:
    def check(rules: list[dict[str, Any]]) -> None:
        live = ' and on(slot) (specdeploy:slot_traffic_percent{namespace="specdeploy"} > 0)'
        by_name = {r["alert"]: r["expr"].removesuffix(live) for r in rules}
        assert by_name["SpecdeployHighP99Ttft"].endswith("> 1.5")  # alerting.p99_ttft_s in k8s-prod
        assert by_name["SpecdeployHighErrorRate"].endswith("> 0.01")
        assert by_name["SpecdeployFleetBelowMinimum"].endswith("< 2")  # kubernetes.min_replicas
    return _rules(prod).apply(check)


@pulumi.runtime.test
def test_every_rule_links_its_runbook(prod: Any) -> pulumi.Output[None]:
    base = PROD.alerting.runbook_base_url

    def check(rules: list[dict[str, Any]]) -> None:
        for rule in rules:
            assert rule["annotations"]["runbook_url"] == f"{base}/{rule['alert']}.md"
            assert rule["annotations"]["runbook_url"] in rule["annotations"]["description"]
    return _rules(prod).apply(check)


@pulumi.runtime.test
def test_rule_severity_labels_page_only_on_outages(prod: Any) -> pulumi.Output[None]:
    def check(rules: list[dict[str, Any]]) -> None:
        assert {r["alert"]: r["labels"]["severity"] for r in rules} == {
            name: severity for name, (severity, _, _) in K8S_PROD_RULES.items()}
    return _rules(prod).apply(check)


@pulumi.runtime.test
def test_rules_and_monitor_carry_the_prometheus_release_label(prod: Any) -> pulumi.Output[None]:
    observability = prod().stack.observability

    def check(metadata: Any) -> pulumi.Output[None]:
        assert metadata["labels"]["release"] == "kube-prometheus-stack"
        return observability.service_monitor.metadata.apply(
            lambda m: None if m["labels"]["release"] == "kube-prometheus-stack" else pytest.fail(str(m)))
    return observability.rule.metadata.apply(check)


@pulumi.runtime.test
def test_service_monitor_scrapes_the_slot_services_metrics_port(prod: Any) -> pulumi.Output[None]:
    stack = prod().stack

    def check(monitor: dict[str, Any]) -> pulumi.Output[None]:
        [endpoint] = monitor["endpoints"]
        assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
        assert monitor["namespaceSelector"] == {"matchNames": ["specdeploy"]}

        def selects(service: Any) -> None:
            assert monitor["selector"]["matchLabels"].items() <= service.labels.items()
            assert "authorization" not in endpoint  # metrics_require_auth is false in k8s-prod
        return stack.slots["blue"].service.metadata.apply(selects)
    return stack.observability.service_monitor.spec.apply(check)


@pulumi.runtime.test
def test_service_monitor_labels_series_with_the_slot(prod: Any) -> pulumi.Output[None]:
    def check(monitor: dict[str, Any]) -> None:
        [relabeling] = monitor["endpoints"][0]["relabelings"]
        source = "__meta_kubernetes_service_label_specdeploy_dev_slot"
        assert relabeling == {"action": "replace", "sourceLabels": [source], "targetLabel": "slot"}
    return prod().stack.observability.service_monitor.spec.apply(check)


def test_authenticated_metrics_are_scraped_with_the_metrics_key(render: Any, variant_config: Any) -> None:
    built = render("k8s-dev", variant_config("k8s-dev", service={"metrics_require_auth": True}))
    endpoint = built.one("ServiceMonitor", "specdeploy")["spec"]["endpoints"][0]
    assert endpoint["authorization"] == {"type": "Bearer",
                                         "credentials": {"name": "specdeploy-api-keys", "key": "metrics-key"}}


@pulumi.runtime.test
def test_dashboard_config_map_is_discoverable_by_the_grafana_sidecar(prod: Any) -> pulumi.Output[None]:
    def check(metadata: Any) -> None:
        assert metadata.labels["grafana_dashboard"] == "1"
    return prod().stack.observability.dashboard.metadata.apply(check)


@pulumi.runtime.test
def test_dashboard_json_loads_with_the_expected_panels(prod: Any) -> pulumi.Output[None]:
    def check(data: dict[str, str]) -> None:
        dashboard = json.loads(data["specdeploy-serving.json"])
        titles = {panel["title"] for panel in dashboard["panels"]}
        assert EXPECTED_PANELS <= titles
        assert all(panel["targets"] for panel in dashboard["panels"])
        assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
    return prod().stack.observability.dashboard.data.apply(check)


@pytest.mark.parametrize("expr", dashboard_queries())
def test_dashboard_queries_only_server_series(expr: str, series_of: Any, server_series: set[str]) -> None:
    selected = series_of(expr)
    assert selected, f"no series in {expr!r}"
    assert selected <= server_series, f"unknown series {selected - server_series} in {expr!r}"


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_alert_rules_query_only_server_series(rule: Any, series_of: Any, server_series: set[str]) -> None:
    selected = series_of(rule.promql)
    assert selected <= server_series, f"unknown series {selected - server_series} in {rule.promql!r}"
    assert selected == set(rule.server_metrics)


def test_series_parser_catches_a_foreign_metric(series_of: Any) -> None:
    assert series_of('sum(rate(vllm:num_requests_waiting{pod="x"}[5m]))') == {"vllm:num_requests_waiting"}
    assert series_of("histogram_quantile(0.9, sum by (le) (rate(specdeploy_ttft_bucket[5m])))") == {
        "specdeploy_ttft_bucket"}


def _selectors(expr: str) -> dict[str, list[set[str]]]:
    """Each server series an expression selects -> the label matchers of each of its selections."""
    found: dict[str, list[set[str]]] = {}
    for name, matchers in re.findall(r"\b(specdeploy_[a-zA-Z0-9_]+)(\{[^}]*\})?", expr):
        found.setdefault(name, []).append(set(re.findall(r'[a-z_]+=~?"[^"]*"', matchers)))
    return found


def _with(config: Any, **kubernetes: Any) -> Any:
    assert config.kubernetes is not None
    return config.model_copy(update={"kubernetes": config.kubernetes.model_copy(update=kubernetes)})


@pytest.mark.parametrize("namespace", ["specdeploy", "llm-staging"])
def test_every_rule_selects_only_the_stack_namespace(namespace: str) -> None:
    for rule in alert_rules(_with(PROD, namespace=namespace)):
        selections = _selectors(rule.promql)
        assert set(selections) == set(rule.server_metrics), rule.promql
        for name, matchers in selections.items():
            assert all(f'namespace="{namespace}"' in m for m in matchers), f"{name} unscoped in {rule.promql}"


def test_rules_over_the_serving_signals_fire_per_slot() -> None:
    # One slot's errors are not diluted by the other slot's traffic, and the alert says which slot.
    for rule in RULES:
        if rule.name != "SpecdeployFleetBelowMinimum":
            assert re.search(r"\b(sum|max|avg|count) by \(slot(, le)?\) \(", rule.promql), rule.promql


@pytest.mark.parametrize("active", ["blue", "green"])
def test_fleet_below_minimum_follows_the_live_split_not_the_stack_file(active: str) -> None:
    config = PROD.model_copy(update={"release": PROD.slots.model_copy(update={"active": active})})
    [fleet] = [r for r in alert_rules(config) if r.name == "SpecdeployFleetBelowMinimum"]
    assert fleet.promql == next(r for r in RULES if r.name == "SpecdeployFleetBelowMinimum").promql
    assert f'slot="{active}"' not in fleet.promql  # no slot fixed at `pulumi up` time


def test_the_traffic_rule_records_the_split_the_alerts_join_on(prod: Any) -> pulumi.Output[None]:
    from infra.alerts import TRAFFIC_RECORD

    def check(spec: dict[str, Any]) -> None:
        rules = spec["groups"][0]["rules"]
        assert {(r["record"], r["labels"]["slot"], r["expr"]) for r in rules} == {
            (TRAFFIC_RECORD, "blue", "vector(90)"), (TRAFFIC_RECORD, "green", "vector(10)")}  # k8s-prod: 10 % canary
        assert all(r["labels"]["namespace"] == "specdeploy" for r in rules)

    return prod().stack.observability.traffic.spec.apply(check)


def test_the_traffic_rule_belongs_to_the_release_commands_once_created() -> None:
    from infra.program.preview import record_stack

    [traffic] = [r for r in record_stack("k8s-prod").resources
                 if r.custom and r.inputs.get("metadata", {}).get("name") == "specdeploy-traffic"]
    assert traffic.ignore_changes == ("spec",)  # `pulumi up` never rewrites the live split


def test_the_slot_and_namespace_labels_the_rules_select_are_put_on_the_series(prod: Any) -> None:
    # `slot` comes from the ServiceMonitor's relabeling of the Service label; `namespace` is set on every
    # ServiceMonitor target by the Prometheus Operator from the scraped Service's namespace.
    from infra.components.kubernetes.common import SLOT_LABEL
    from infra.components.kubernetes.observability import _slot_relabeling

    relabel = _slot_relabeling()
    assert relabel["targetLabel"] == "slot"
    assert relabel["sourceLabels"] == ["__meta_kubernetes_service_label_" + re.sub(r"\W", "_", SLOT_LABEL)]
