"""Prometheus' own rule engine (`promtool test rules`) over the rendered rules of stack k8s-prod: paging follows
the split the release commands record in `specdeploy-traffic`, not the slot the stack file calls active.

Each case loads the alert rules and the traffic recording rule exactly as rendered for a split (the traffic
rule as `specdeploy rollout|rollback` patch it: `traffic_rule_groups`), feeds per-pod series, and states
which slot each alert fires for at minute 30 (every other alert: none). CI installs promtool (.ci/run); a
machine without it skips these cases, the text-level checks in test_observability.py still run.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.alerts import alert_rules, traffic_rule_groups
from infra.components.kubernetes.observability import prometheus_rule
from infra.config import load_stack
from serving import metric_names as m

PROD = load_stack("k8s-prod").config  # blue active at 90 %, green canary 10 %; min_replicas 2
NS = PROD.kubernetes.namespace if PROD.kubernetes else "specdeploy"
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")


def pods(slot: str, ready: list[int], *, memory_share: float = 0.5, requests_per_min: int = 0,
         errors_per_min: int = 0) -> list[dict[str, str]]:
    """Series of one slot: each pod's readiness and GPU memory, and the slot's request counters."""
    series: list[dict[str, str]] = []
    for index, state in enumerate(ready):
        labels = f'namespace="{NS}",slot="{slot}",pod="specdeploy-{slot}-{index}"'
        series += [{"series": f"{m.READY}{{{labels}}}", "values": f"{state}x40"},
                   {"series": f"{m.GPU_MEMORY_USED}{{{labels}}}", "values": f"{memory_share * 80e9:.0f}x40"},
                   {"series": f"{m.GPU_MEMORY_TOTAL}{{{labels}}}", "values": "80000000000x40"}]
    for status, per_min in (("200", requests_per_min), ("500", errors_per_min)):
        if per_min:
            series.append({"series": f'{m.REQUESTS}_total{{namespace="{NS}",slot="{slot}",status="{status}"}}',
                           "values": f"0+{per_min}x40"})
    return series


def fires(tmp_path: Path, split: dict[str, int], series: list[dict[str, str]], expected: dict[str, list[str]]) -> None:
    """promtool: at minute 30 each alert fires for exactly the slots `expected` lists for it."""
    base = PROD.alerting.runbook_base_url
    rendered = [prometheus_rule(rule, base) for rule in alert_rules(PROD)]
    rule_file = tmp_path / "rules.yaml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "specdeploy", "rules": rendered},
                                                    *traffic_rule_groups(NS, split)]}))
    checks: list[dict[str, Any]] = [
        {"eval_time": "30m", "alertname": rule["alert"],
         "exp_alerts": [{"exp_labels": {**rule["labels"], "slot": slot}, "exp_annotations": rule["annotations"]}
                        for slot in expected.get(rule["alert"], [])]}
        for rule in rendered]
    unknown = set(expected) - {rule["alert"] for rule in rendered}
    assert not unknown, unknown
    test_file = tmp_path / "test.yaml"
    test_file.write_text(yaml.safe_dump({"rule_files": [str(rule_file)], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": series, "alert_rule_test": checks}]}))
    assert PROMTOOL is not None
    run = subprocess.run([PROMTOOL, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert run.returncode == 0, run.stdout + run.stderr


def test_an_idle_slot_pages_for_nothing(tmp_path: Path) -> None:
    # blue serves everything and is healthy; green is idle: warming (unready), memory preallocated, below floor
    series = pods("blue", [1, 1], requests_per_min=60) + pods("green", [0], memory_share=0.95)
    fires(tmp_path, {"blue": 100, "green": 0}, series, {})


def test_after_an_unrecorded_rollout_the_new_slot_pages(tmp_path: Path) -> None:
    # the stack file still says blue; the release commands moved all traffic to green, which is failing
    series = pods("green", [1, 0], memory_share=0.95, requests_per_min=60, errors_per_min=30) + pods("blue", [0])
    fires(tmp_path, {"blue": 0, "green": 100}, series, {
        "SpecdeployHighErrorRate": ["green"], "SpecdeployGpuMemoryHigh": ["green"],
        "SpecdeployUnhealthyHosts": ["green"], "SpecdeployFleetBelowMinimum": ["green"]})


def test_a_canary_slot_pages_too_and_a_dead_live_slot_counts_zero(tmp_path: Path) -> None:
    # 10 % canary on green with a single ready pod; blue's pods are all gone (no series left at all)
    series = pods("green", [1], requests_per_min=6)
    fires(tmp_path, {"blue": 90, "green": 10}, series, {"SpecdeployFleetBelowMinimum": ["blue", "green"]})


def test_a_rollback_silences_the_slot_it_leaves(tmp_path: Path) -> None:
    # green still failing, but the rollback moved every request back to blue: green no longer pages
    series = pods("green", [1, 0], memory_share=0.95, requests_per_min=60, errors_per_min=30)
    series += pods("blue", [1, 1], requests_per_min=60)
    fires(tmp_path, {"blue": 100, "green": 0}, series, {})
