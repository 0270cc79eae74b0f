from __future__ import annotations

from pathlib import Path

from infra.validation.local_server import Listener, config_path_of, parse_ss, run_as
from infra.validation.runner import pytest_command

SS = """LISTEN 0      2048       127.0.0.1:8000      0.0.0.0:*    users:(("python",pid=1234,fd=13))
LISTEN 0      128          0.0.0.0:22        0.0.0.0:*
LISTEN 0      511             [::]:8000         [::]:*    users:(("python",pid=99,fd=7))
LISTEN 0      4096   127.0.0.53%lo:53        0.0.0.0:*
"""


def test_parse_ss_reads_address_port_and_owner() -> None:
    assert parse_ss(SS) == [Listener("127.0.0.1", 8000, 1234), Listener("0.0.0.0", 22, None),
                            Listener("[::]", 8000, 99), Listener("127.0.0.53", 53, None)]


def test_config_path_comes_from_the_command_line_or_the_environment() -> None:
    argv = ["python", "-m", "infra.cli.main", "serve", "--config", "state/server.yaml"]
    assert config_path_of(argv, {}, Path("/repo")) == Path("/repo/state/server.yaml")
    assert config_path_of(["serve"], {"SPECDEPLOY_CONFIG": "/etc/s.yaml"}) == Path("/etc/s.yaml")
    assert config_path_of(["serve"], {}) is None


def test_run_as_drops_to_the_user_and_keeps_only_read_search_when_asked() -> None:
    assert run_as(65534, 65534) == ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    assert "--ambient-caps=+dac_read_search" in run_as(1, 1, read_anywhere=True)


def test_runner_runs_only_launch_checks_with_a_timeout_covering_the_profile(tmp_path: Path) -> None:
    command = pytest_command("http://h:1", "prod", "standard", tmp_path, hosts=["ssh://a", "ssh://b"])
    assert command[command.index("-m", 3) + 1] == "launch"
    assert "--timeout=1800" in command  # 15 min sustained + margin
    assert command[command.index("--hosts") + 1] == "ssh://a,ssh://b"
