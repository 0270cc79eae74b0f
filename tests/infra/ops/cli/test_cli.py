"""The `specdeploy` entry point and the config subcommands."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from infra.ops.cli.main import main
from serving import __version__


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_help_lists_config(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "config" in capsys.readouterr().out


def test_validate_all_stacks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "validate"]) == 0
    out = capsys.readouterr().out
    for name in ("local", "dev", "staging", "prod"):
        assert f"ok   {name}" in out


def test_show_masks_secrets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--stack", "prod"]) == 0
    out = capsys.readouterr().out
    assert "apiKeys: '[secret]'" in out
    assert "placeholder-ciphertext" not in out


def test_show_renders_server_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--stack", "local", "--server-config"]) == 0
    assert "max_concurrency: 16" in capsys.readouterr().out


def test_unknown_stack_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--stack", "nope"]) == 2
    assert "stack 'nope'" in capsys.readouterr().err


def test_cli_starts_without_heavy_imports() -> None:
    code = (
        "import sys; from infra.ops.cli.main import build_parser; build_parser(); "
        "heavy = [m for m in ('torch', 'transformers', 'pulumi', 'pulumi_aws', 'boto3') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "", f"imported at CLI start: {result.stdout}"
    assert time.perf_counter() - started < 10
