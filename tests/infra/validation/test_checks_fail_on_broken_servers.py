"""The launch checks themselves: each fault of a deliberately broken server fails its check, and
the same check passes against the healthy version of that server (so the fault is what it caught)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from infra.config import REPO_ROOT

pytestmark = pytest.mark.slow

SUITE = REPO_ROOT / "tests" / "launch"


def run_checks(endpoint: str, report_dir: Path, module: str, select: str, *extra: str) -> dict[str, str]:
    """Run launch checks of one module matching ``select``; returns {test name: outcome}."""
    env = {k: v for k, v in os.environ.items() if k != "SPECDEPLOY_API_KEY"}
    command = [sys.executable, "-m", "pytest", str(SUITE / module), "-m", "launch", "-k", select, "-q",
               "-p", "no:cacheprovider", "--endpoint", endpoint, "--stack", "local", "--report", str(report_dir),
               *extra]
    subprocess.run(command, cwd=REPO_ROOT, env=env, check=False, capture_output=True, timeout=300)
    report = json.loads((report_dir / "report.json").read_text())
    return {c["nodeid"].split("::", 1)[1]: c["outcome"] for c in report["checks"]}


@pytest.mark.parametrize("broken", [False, True], ids=["healthy", "truncating"])
def test_truncating_server_fails_the_typical_request_check(tmp_path: Path, broken: bool, serve_fake: Any) -> None:
    with serve_fake(truncate=broken) as (endpoint, _):
        outcomes = run_checks(endpoint, tmp_path, "test_functional.py", "typical_request")
    assert len(outcomes) == 4  # one per prompt set
    expected = "failed" if broken else "passed"
    assert set(outcomes.values()) == {expected}, outcomes


@pytest.mark.parametrize("broken", [False, True], ids=["healthy", "leaking"])
def test_leaking_server_fails_the_memory_trend_check(tmp_path: Path, broken: bool, serve_fake: Any) -> None:
    with serve_fake(leak=broken) as (endpoint, _):
        outcomes = run_checks(endpoint, tmp_path, "test_stability.py", "memory_has_no_upward_trend",
                              "--sustained-s", "5")
    assert list(outcomes.values()) == ["failed" if broken else "passed"], outcomes


@pytest.mark.parametrize("broken", [False, True], ids=["healthy", "holding-kv"])
def test_server_keeping_kv_blocks_after_disconnect_fails_the_disconnect_check(tmp_path: Path, broken: bool,
                                                                              serve_fake: Any) -> None:
    with serve_fake(hold_kv=broken) as (endpoint, state):
        outcomes = run_checks(endpoint, tmp_path, "test_functional.py", "disconnect_mid_stream")
    assert list(outcomes.values()) == ["failed" if broken else "passed"], outcomes
    assert (state.kv_used > 0) == broken
