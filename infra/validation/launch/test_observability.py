"""6. Observability: every series the alerts read is exported; on the cloud every alarm links its runbook.

Guide: 八.4 (dashboards complete, alerts reach someone) and 九 (GPU, memory, P99, error-rate alerts).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from infra.validation import prom
from serving import metric_names

pytestmark = pytest.mark.launch

_GPU_SERIES = {metric_names.GPU_MEMORY_USED, metric_names.GPU_MEMORY_TOTAL, metric_names.GPU_UTILIZATION}


@pytest.fixture(scope="module")
def exported(http: httpx.Client, model_name: str) -> set[str]:
    """Series on /metrics after at least one request (request counters appear with their first sample)."""
    http.post("/v1/completions", json={"model": model_name, "prompt": "def main():", "max_tokens": 2})
    response = http.get("/metrics")
    assert response.status_code == 200, response.text[:300]
    return prom.series_names(response.text)


def _gpu_deployment(exported: set[str], request: pytest.FixtureRequest) -> bool:
    """A GPU deployment: the server reports GPU memory, or a serving host has nvidia-smi."""
    if metric_names.GPU_MEMORY_TOTAL in exported:
        return True
    import testinfra

    try:
        hosts = request.getfixturevalue("serving_hosts")
    except pytest.skip.Exception:  # a cloud stack without --hosts: only /metrics can tell
        return False
    return any(testinfra.get_host(spec).exists("nvidia-smi") for spec in hosts)


def test_metrics_page_is_prometheus_text(http: httpx.Client) -> None:
    response = http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain"), response.headers["content-type"]
    assert prom.parse(response.text), "no samples on /metrics"


def test_metrics_export_every_series_an_alert_reads(exported: set[str], alert_series: tuple[str, str],
                                                    request: pytest.FixtureRequest) -> None:
    rule, series = alert_series
    base = series.removesuffix("_bucket").removesuffix("_total")
    if base in _GPU_SERIES and not _gpu_deployment(exported, request):
        pytest.skip(f"{series} ({rule}) is a GPU series and this is a CPU deployment")
    assert series in exported, f"alert {rule} reads {series}, which /metrics does not export"


def test_every_alarm_links_its_runbook(stack: Any, options: Any) -> None:
    if stack.platform != "aws":
        pytest.skip(f"{stack.platform} stack: no CloudWatch alarms (PrometheusRule annotations carry runbook_url)")
    from infra.alerts import alert_rules
    from infra.config import load_stack
    from infra.validation.cloud import alarm_name, stack_alarms

    alarms = stack_alarms(options.stack, load_stack(options.stack).providers.get("aws:region"))
    base = stack.alerting.runbook_base_url
    descriptions = {name: alarm.get("AlarmDescription", "") for name, alarm in alarms.items()}
    unlinked = [rule.name for rule in alert_rules(stack)
                if rule.runbook_url(base) not in descriptions.get(alarm_name(options.stack, rule), "")]
    assert not unlinked, f"alarms without a runbook link: {unlinked}"


def test_every_alarm_has_its_runbook_file(stack: Any) -> None:
    if stack.platform != "aws":
        pytest.skip(f"{stack.platform} stack: no CloudWatch alarms")
    from infra.alerts import alert_rules
    from infra.config import project_dir

    runbooks = project_dir() / "runbooks"
    if not runbooks.is_dir():
        pytest.skip(f"no runbooks/ directory in the project {runbooks.parent}: cannot check the runbook files")
    missing = [rule.name for rule in alert_rules(stack) if not (runbooks / f"{rule.name}.md").is_file()]
    assert not missing, f"alarms without a runbook file in {runbooks}: {missing}"
