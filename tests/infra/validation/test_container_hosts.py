"""Where the launch suite's host checks run: this machine for a local process, inside the server's
container (testinfra's podman:// backend) for the local container runtime, nowhere by default on a
cloud stack; and the report says which."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from infra.validation.launch.conftest import container_of
from infra.validation.record import LaunchRun
from infra.validation.report import render_markdown, write_report
from infra.validation.runner import LAUNCH_SUITE, container_environment, default_hosts

REPO = Path(__file__).resolve().parents[3]


def test_default_hosts_follow_the_stack_runtime() -> None:
    assert default_hosts("local") == ["local://"]
    assert default_hosts("local-container") == ["podman://specdeploy-local-container"]
    assert default_hosts("prod") == []


def test_podman_hosts_get_the_project_podman_configuration() -> None:
    assert container_environment(["local://"]) == {}
    env = container_environment(["podman://specdeploy-local-container"])
    assert sorted(env) == ["CONTAINERS_CONF", "CONTAINERS_REGISTRIES_CONF", "CONTAINERS_STORAGE_CONF"]
    assert all(Path(path).is_file() for path in env.values())


def test_container_name_is_read_from_a_single_podman_host() -> None:
    assert container_of(["podman://specdeploy-x"]) == "specdeploy-x"
    assert container_of(["podman://root@specdeploy-x"]) == "specdeploy-x"
    assert container_of(["local://"]) is None
    assert container_of(["podman://a", "podman://b"]) is None


def _collected_host_checks(stack: str, *extra: str) -> list[str]:
    """Node ids of the host checks the suite collects for ``stack`` (no deployment is contacted)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(LAUNCH_SUITE / "test_host.py"), "-m", "launch", "--collect-only", "-q",
         "-p", "no:cacheprovider", "--endpoint", "http://127.0.0.1:9", "--stack", stack, *extra],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return [line for line in result.stdout.splitlines() if "::test_" in line]


@pytest.mark.slow
def test_the_suite_inspects_the_container_of_a_container_stack() -> None:
    container = _collected_host_checks("local-container")
    assert container and all(line.endswith("podman://specdeploy-local-container]") for line in container), container
    local = _collected_host_checks("local")
    assert local and all(line.endswith("local]") for line in local), local
    given = _collected_host_checks("local-container", "--hosts", "ssh://ops@10.0.1.5")
    assert given and all(line.endswith("ssh://10.0.1.5]") for line in given), given  # testinfra's id


def _run(server: str, hosts: list[str]) -> LaunchRun:
    slo = {"ttft_p99_ms": 2000, "tpot_p99_ms": 200, "e2e_p99_s": 30, "min_tokens_per_s": 0, "max_error_rate": 0.0,
           "target_concurrency": 4, "memory_slope_mb_per_min": 5.0}
    return LaunchRun("local-container", "http://127.0.0.1:8010", "quick", slo, server=server, hosts=hosts)


def test_report_says_the_server_ran_in_a_container_and_where_host_checks_ran(tmp_path: Path) -> None:
    run = _run("container (image localhost/specdeploy-server:cpu, podman)", ["podman://specdeploy-local-container"])
    markdown = render_markdown(run)
    assert ("Server: container (image localhost/specdeploy-server:cpu, podman); host checks on "
            "podman://specdeploy-local-container.") in markdown
    data = json.loads(write_report(run, tmp_path)["json"].read_text())
    assert data["server"].startswith("container") and data["hosts"] == ["podman://specdeploy-local-container"]


def test_report_without_server_facts_has_no_server_line() -> None:
    assert "Server:" not in render_markdown(_run("", []))
