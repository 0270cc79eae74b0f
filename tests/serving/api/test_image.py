"""serving/Dockerfile (no Docker engine here): its structure, and the entrypoint command it runs."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
DOCKERFILE = (REPO / "serving" / "Dockerfile").read_text()
SPECDEPLOY = Path(sys.executable).with_name("specdeploy")


def _instructions(name: str) -> list[str]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.startswith(name + " ")]


def test_multi_stage_with_cpu_and_cuda_bases_chosen_by_build_arg() -> None:
    froms = _instructions("FROM")
    assert "ARG VARIANT=cpu" in DOCKERFILE
    assert any(f.endswith("AS base-cpu") for f in froms)
    assert any(f.startswith("nvidia/cuda:") and f.endswith("AS base-cuda") for f in froms)
    assert "base-${VARIANT} AS build" in froms
    assert "base-${VARIANT} AS runtime" in froms
    assert "COPY --from=build /opt/specdeploy /opt/specdeploy" in DOCKERFILE


def test_runs_as_a_non_root_user() -> None:
    users = _instructions("USER")
    assert users and users[-1].split(":")[0] not in ("root", "0")


def test_healthcheck_probes_health() -> None:
    (check,) = _instructions("HEALTHCHECK")
    assert "/health" in check and "--start-period" in check


def test_entrypoint_is_specdeploy_serve_with_the_mounted_config() -> None:
    assert _instructions("ENTRYPOINT") == ['["specdeploy", "serve"]']
    assert _instructions("CMD")[-1] == '["--config", "/etc/specdeploy/server.yaml"]'


def test_installs_only_the_serve_extra() -> None:
    assert 'pip install ".[serve]"' in DOCKERFILE
    assert "infra]" not in DOCKERFILE and "dev]" not in DOCKERFILE


@pytest.mark.skipif(not SPECDEPLOY.exists(), reason="console script not installed")
def test_entrypoint_command_starts_fast_and_documents_itself() -> None:
    started = time.monotonic()
    result = subprocess.run([str(SPECDEPLOY), "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--config" in result.stdout and "SIGTERM" in result.stdout
    assert time.monotonic() - started < 20


@pytest.mark.skipif(not SPECDEPLOY.exists(), reason="console script not installed")
def test_entrypoint_without_config_fails_with_one_line(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run([str(SPECDEPLOY), "serve"], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert result.stderr.strip() == "specdeploy: error: no config file: pass --config FILE or set SPECDEPLOY_CONFIG"


@pytest.mark.skipif(not SPECDEPLOY.exists(), reason="console script not installed")
def test_entrypoint_with_an_invalid_config_names_the_key(tmp_path: Path) -> None:
    config = tmp_path / "server.yaml"
    config.write_text("model: {path: /m}\nscheduler: {max_queue: -1}\n")
    result = subprocess.run([str(SPECDEPLOY), "serve", "--config", str(config)], capture_output=True, text=True,
                            timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert result.returncode == 2
    assert "scheduler.max_queue" in result.stderr
