from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from infra.ops.cli import weights_cmd
from infra.ops.cli.main import CommandError


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    weights_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return int(args.func(args))


def test_push_pull_verify_through_the_command(model_dir: Path, tmp_path: Path) -> None:
    uri = f"file://{tmp_path / 'store'}"
    assert _run("weights", "push", str(model_dir), uri, "--quiet") == 0
    assert _run("weights", "pull", uri, str(tmp_path / "cache" / "m"), "--quiet") == 0
    assert _run("weights", "verify", str(tmp_path / "cache" / "m"), "--quiet") == 0


def test_verify_failure_is_a_command_error_naming_the_file(model_dir: Path, tmp_path: Path) -> None:
    uri = f"file://{tmp_path / 'store'}"
    _run("weights", "push", str(model_dir), uri, "--quiet")
    _run("weights", "pull", uri, str(tmp_path / "m"), "--quiet")
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(CommandError, match=r"config\.json"):
        _run("weights", "verify", str(tmp_path / "m"), "--quiet")


def test_s3_round_trip_with_an_explicit_endpoint(
    s3_bucket: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    uri = f"s3://{s3_bucket}/cli/v1"
    assert _run("weights", "push", str(model_dir), uri, "--endpoint-url", endpoint, "--quiet") == 0
    assert _run("weights", "pull", uri, str(tmp_path / "m"), "--endpoint-url", endpoint, "--quiet") == 0
    assert _run("weights", "verify", str(tmp_path / "m"), "--quiet") == 0
