"""ruff and mypy are part of the test run, so style and typing regressions fail CI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def test_ruff_is_clean() -> None:
    result = subprocess.run([str(BIN / "ruff"), "check", "infra", "serving", "tests"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow  # ~60 s: the slow tier; `make lint` runs it alone
def test_mypy_is_clean() -> None:
    result = subprocess.run([str(BIN / "mypy")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
