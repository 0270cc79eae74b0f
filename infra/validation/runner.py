"""``run_validation``: run the launch suite (infra/validation/launch) against one endpoint and return the verdict.

The suite runs in its own pytest process, so a caller (``specdeploy validate``, ``specdeploy
rollout``, the CI test) gets a clean interpreter for it and can run it more than once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.config import load_stack, project_dir
from infra.runtime.podman import podman_env
from infra.runtime.state import container_name, local_paths
from infra.validation.profiles import get_profile
from infra.validation.record import REPORT_HTML, REPORT_JSON, REPORT_MD

# Packaged with infra, so an installed wheel runs the same checks as a source checkout.
LAUNCH_SUITE = Path(__file__).resolve().parent / "launch"
API_KEY_ENV = "SPECDEPLOY_API_KEY"
# Beyond the load the profile asks for: start-up checks, functional checks, report rendering.
_TIMEOUT_MARGIN_S = 900


@dataclass(frozen=True)
class ValidationResult:
    passed: bool  # the launch verdict: every check that ran passed
    exit_code: int  # pytest's: 0 pass, 1 checks failed, 2+ the suite itself could not run
    report_dir: Path
    summary: dict[str, Any] = field(default_factory=dict)  # report.json, empty when none was written

    @property
    def report_html(self) -> Path:
        return self.report_dir / REPORT_HTML

    @property
    def report_markdown(self) -> Path:
        return self.report_dir / REPORT_MD

    @property
    def recommendation(self) -> dict[str, Any] | None:
        rec: dict[str, Any] | None = self.summary.get("speculative_recommendation")
        return rec

    @property
    def failed_checks(self) -> list[str]:
        return [c["nodeid"] for c in self.summary.get("checks", []) if c["outcome"] == "failed"]


def default_endpoint(stack: str) -> str:
    """Where a stack's server answers when the caller names none: the local platform's loopback port."""
    config = load_stack(stack).config
    if config.platform != "local":
        raise ValueError(f"stack {stack!r} is on {config.platform}: pass the endpoint (load balancer or ingress URL)")
    return f"http://{config.local.host}:{config.service.port}"


def local_api_key(stack: str) -> str | None:
    """For a local stack, the key `specdeploy up` wrote into its state directory (None elsewhere)."""
    stack_file = load_stack(stack)
    if stack_file.config.platform != "local":
        return None
    return local_paths(stack_file).api_key()


def default_hosts(stack: str) -> list[str]:
    """Testinfra backends of a stack's serving hosts when the caller names none: this machine
    (``local://``) for a local process, the server's container (``podman://NAME``) for the local
    platform's container runtime, none for a cloud stack (the operator's machine is not a serving host)."""
    stack_file = load_stack(stack)
    if stack_file.config.platform != "local":
        return []
    if stack_file.config.local.runtime == "container":
        return [f"podman://{container_name(stack_file)}"]
    return ["local://"]


def container_environment(hosts: Sequence[str]) -> dict[str, str]:
    """What `podman exec` needs to find our containers (storage and config under the project's podman
    directory, infra/runtime/podman.py) when a host is ``podman://``; empty otherwise."""
    if not any(spec.startswith("podman://") for spec in hosts):
        return {}
    env = podman_env()
    return {key: env[key] for key in ("CONTAINERS_STORAGE_CONF", "CONTAINERS_REGISTRIES_CONF", "CONTAINERS_CONF")}


def default_report_dir(stack: str, profile: str) -> Path:
    """``<project>/reports/<stack>-<profile>-<UTC time>``."""
    return project_dir() / "reports" / f"{stack}-{profile}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"


def pytest_command(endpoint: str, stack: str, profile: str, report_dir: Path, hosts: Sequence[str] | None = None,
                   extra_args: Sequence[str] = ()) -> list[str]:
    timeout = int(get_profile(profile).sustained_s + _TIMEOUT_MARGIN_S)
    command = [sys.executable, "-m", "pytest", str(LAUNCH_SUITE), "-m", "launch", "-p", "no:cacheprovider",
               "-q", "-rfEs", f"--timeout={timeout}", "--endpoint", endpoint, "--stack", stack,
               "--profile", profile, "--report", str(report_dir)]
    if hosts:
        command += ["--hosts", ",".join(hosts)]
    return [*command, *extra_args]


def run_validation(endpoint: str | None, stack: str, profile: str = "quick", report_dir: Path | str | None = None,
                   api_key: str | None = None, hosts: Sequence[str] | None = None,
                   extra_args: Sequence[str] = ()) -> ValidationResult:
    """Run the launch checks of ``profile`` against ``endpoint`` and write the report.

    ``hosts``: testinfra backends of the serving hosts (``ssh://user@10.0.1.5``, ``local://``,
    ``kubectl://pod?namespace=ns``); the host checks run on each. ``api_key`` defaults to
    $SPECDEPLOY_API_KEY, then (local stacks) to the key `specdeploy up` generated. Returns the verdict
    and where the report is.
    """
    get_profile(profile)  # fail fast on a typo, before a subprocess starts
    endpoint = endpoint or default_endpoint(stack)
    directory = Path(report_dir).resolve() if report_dir is not None else default_report_dir(stack, profile)
    env = dict(os.environ)
    api_key = api_key or env.get(API_KEY_ENV) or local_api_key(stack)
    if api_key is not None:
        env[API_KEY_ENV] = api_key
    command = pytest_command(endpoint, stack, profile, directory, hosts, extra_args)
    # In the project directory, the suite finds the same Pulumi.yaml and stacks as this process.
    completed = subprocess.run(command, cwd=project_dir(), env=env, check=False)
    summary: dict[str, Any] = {}
    report = directory / REPORT_JSON
    if report.is_file():
        summary = json.loads(report.read_text(encoding="utf-8"))
    passed = completed.returncode == 0 and bool(summary.get("passed"))
    return ValidationResult(passed=passed, exit_code=completed.returncode, report_dir=directory, summary=summary)
