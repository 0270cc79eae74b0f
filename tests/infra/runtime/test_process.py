"""The server-process runtime's pure parts: which config a `serve` process runs, and dropping to a user."""

from __future__ import annotations

from pathlib import Path

from infra.runtime.process import config_path_of, run_as


def test_config_path_comes_from_the_command_line_or_the_environment() -> None:
    argv = ["python", "-m", "infra.ops.cli.main", "serve", "--config", "state/server.yaml"]
    assert config_path_of(argv, {}, Path("/repo")) == Path("/repo/state/server.yaml")
    assert config_path_of(["serve"], {"SPECDEPLOY_CONFIG": "/etc/s.yaml"}) == Path("/etc/s.yaml")
    assert config_path_of(["serve"], {}) is None


def test_run_as_drops_to_the_user_and_keeps_only_read_search_when_asked() -> None:
    assert run_as(65534, 65534) == ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    assert "--ambient-caps=+dac_read_search" in run_as(1, 1, read_anywhere=True)
