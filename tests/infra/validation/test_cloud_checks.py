"""The AWS launch checks against CloudWatch in a loopback moto server: alarms of the prod stack
exist, are OK and link their runbooks; a missing, firing or unlinked alarm fails its check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra.alerts import alert_rules
from infra.config import REPO_ROOT, load_stack
from infra.validation.cloud import alarm_name

pytestmark = pytest.mark.slow

STACK = "prod"


@pytest.fixture(scope="module")
def cloudwatch() -> Iterator[tuple[Any, dict[str, str]]]:
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{server._server.server_port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    client = boto3.client("cloudwatch", region_name="us-east-1", endpoint_url=env["AWS_ENDPOINT_URL"],
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    try:
        yield client, env
    finally:
        server.stop()


def _put_alarms(client: Any, state: str = "OK", link: bool = True, skip: str | None = None) -> None:
    config = load_stack(STACK).config
    existing = [a["AlarmName"] for a in client.describe_alarms()["MetricAlarms"]]
    if existing:
        client.delete_alarms(AlarmNames=existing)
    for rule in alert_rules(config):
        if rule.name == skip:
            continue
        name = alarm_name(STACK, rule)
        description = rule.description(config.alerting.runbook_base_url) if link else rule.summary
        client.put_metric_alarm(AlarmName=name, AlarmDescription=description, MetricName="m", Namespace="n",
                                Statistic="Average", Period=60, EvaluationPeriods=1, Threshold=rule.threshold,
                                ComparisonOperator="GreaterThanThreshold")
        client.set_alarm_state(AlarmName=name, StateValue=state, StateReason="test")


def _outcomes(env: dict[str, str], endpoint: str, report_dir: Path) -> dict[str, str]:
    command = [sys.executable, "-m", "pytest", str(REPO_ROOT / "tests" / "launch"), "-m", "launch", "-q",
               "-p", "no:cacheprovider", "-k", "alarm", "--endpoint", endpoint, "--stack", STACK,
               "--report", str(report_dir)]
    subprocess.run(command, cwd=REPO_ROOT, env={**os.environ, **env}, check=False, capture_output=True, timeout=120)
    checks = json.loads((report_dir / "report.json").read_text())["checks"]
    return {c["nodeid"].rsplit("::", 1)[1]: c["outcome"] for c in checks}


@pytest.mark.parametrize(("setup", "expected"), [
    ({}, {"test_cloud_alarms_exist_and_are_ok": "passed", "test_every_alarm_links_its_runbook": "passed"}),
    ({"state": "ALARM"}, {"test_cloud_alarms_exist_and_are_ok": "failed",
                          "test_every_alarm_links_its_runbook": "passed"}),
    ({"skip": "SpecdeployHighErrorRate"}, {"test_cloud_alarms_exist_and_are_ok": "failed",
                                           "test_every_alarm_links_its_runbook": "failed"}),
    ({"link": False}, {"test_cloud_alarms_exist_and_are_ok": "passed",
                       "test_every_alarm_links_its_runbook": "failed"}),
], ids=["all-ok", "one-firing", "one-missing", "no-runbook-links"])
def test_alarm_checks(cloudwatch: tuple[Any, dict[str, str]], serve_fake: Any, tmp_path: Path,
                      setup: dict[str, Any], expected: dict[str, str]) -> None:
    client, env = cloudwatch
    _put_alarms(client, **setup)
    with serve_fake() as (endpoint, _):
            # The runbook files are in this project whatever the cloud says: that check passes in every case.
        assert _outcomes(env, endpoint, tmp_path) == {**expected, "test_every_alarm_has_its_runbook_file": "passed"}
