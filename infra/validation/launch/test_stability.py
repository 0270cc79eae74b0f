"""5. Stability: sustained load without a leak trend, OOM, restart or bunched errors; alarms armed.

Guides: 七.4 (hours without OOM or leak trend, no clustered error logs, alerts in force) and
八.3 (memory curve flat under sustained load; slow growth means a leak or an unbounded cache).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from infra.validation.stats import error_clustering

pytestmark = pytest.mark.launch


def test_memory_has_no_upward_trend_under_sustained_load(sustained: Any, launch_run: Any) -> None:
    from infra.validation.record import MEMORY_NOISE_FLOOR_MIB, memory_leak_suspected

    trend = launch_run.memory_trend()
    assert trend is not None, "too few memory samples during the sustained run"
    limit = launch_run.slo["memory_slope_mb_per_min"]
    assert not memory_leak_suspected(trend, limit), (
        f"RSS grows {trend['slope_mib_per_min']:+.2f} MiB/min under load (limit {limit:g}), "
        f"{trend['growth_mib']:+.1f} MiB over the run (noise floor {MEMORY_NOISE_FLOOR_MIB:g}): "
        "a leak or an unbounded cache")


def test_no_request_is_lost_to_a_crash_or_oom(sustained: Any) -> None:
    lost = [r for r in sustained.records if r.status in (0, 502, 503, 599)]
    assert not lost, f"{len(lost)} requests lost to connection errors or broken streams: {lost[0].error}"


def test_server_process_was_not_restarted_by_the_load(sustained: Any, server_facts_before_load: dict[str, Any],
                                                      server_facts: Any) -> None:
    after = server_facts()
    changed = {spec: (before.pid, after[spec].pid) for spec, before in server_facts_before_load.items()
               if after[spec].pid != before.pid}
    assert not changed, f"server process replaced during the run (crash, OOM kill or restart): {changed}"


def test_no_oom_kill_in_the_server_cgroup_during_the_load(sustained: Any, server_facts_before_load: dict[str, Any],
                                                          server_facts: Any) -> None:
    after = server_facts()
    counts = {spec: (before.oom_kills, after[spec].oom_kills) for spec, before in server_facts_before_load.items()}
    if all(b is None or a is None for b, a in counts.values()):
        pytest.skip("no readable memory cgroup counters on the serving hosts")
    killed = {spec: a - b for spec, (b, a) in counts.items() if a is not None and b is not None and a > b}
    assert not killed, f"OOM kills during the run: {killed}"


def test_errors_are_not_clustered_in_time(sustained: Any) -> None:
    times = [r.start_s for r in sustained.records if not r.ok]
    clustering = error_clustering(times, 0.0, sustained.duration_s)
    assert not clustering.clustered, (f"{clustering.busiest_share:.0%} of {clustering.errors} errors fall in one "
                                      f"tenth of the run: an incident, not noise")


def test_server_is_healthy_after_sustained_load(sustained: Any, endpoint: str) -> None:
    assert httpx.get(f"{endpoint}/health", timeout=10).status_code == 200
    assert httpx.get(f"{endpoint}/ready", timeout=10).status_code == 200


def test_cloud_alarms_exist_and_are_ok(stack: Any, options: Any) -> None:
    if stack.platform != "aws":
        pytest.skip(f"{stack.platform} stack: no CloudWatch alarms to check")
    from infra.alerts import alert_rules
    from infra.config import load_stack
    from infra.validation.cloud import alarm_name, stack_alarms

    alarms = stack_alarms(options.stack, load_stack(options.stack).providers.get("aws:region"))
    names = [alarm_name(options.stack, rule) for rule in alert_rules(stack)]
    missing = [name for name in names if name not in alarms]
    assert not missing, f"alarms missing: {missing}"
    firing = {name: alarms[name]["StateValue"] for name in names if alarms[name]["StateValue"] != "OK"}
    assert not firing, f"alarms not OK: {firing}"
