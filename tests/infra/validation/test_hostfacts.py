from __future__ import annotations

import os
import socket
from pathlib import Path

from infra.validation.hostfacts import Listener, listeners, parse_proc_net_tcp, plaintext_secrets, server_pid
from infra.validation.runner import pytest_command

# /proc/net/tcp and tcp6: 127.0.0.1:8000 and 0.0.0.0:22 listening, one established, [::]:8000 and [::1]:53
PROC_NET_TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000 10001        0 5001 1 0 100 0 0 10 0
   1: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5002 1 0 100 0 0 10 0
   2: 0100007F:1F40 0100007F:D431 01 00000000:00000000 00:00000000 00000000 10001        0 5003 1 0 20 4 30 10 -1
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when
   0: 00000000000000000000000000000000:1F40 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 \
00000000     0        0 6001 1 0 100 0 0 10 0
   1: 00000000000000000000000001000000:0035 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 \
00000000   101        0 6002 1 0 100 0 0 10 0
"""


def test_proc_net_tcp_gives_listening_address_port_owner_and_inode() -> None:
    assert parse_proc_net_tcp(PROC_NET_TCP) == [
        Listener("127.0.0.1", 8000, 10001, 5001), Listener("0.0.0.0", 22, 0, 5002),
        Listener("[::]", 8000, 0, 6001), Listener("[::1]", 53, 101, 6002)]


def test_the_server_behind_a_port_is_found_on_this_machine() -> None:
    import testinfra

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        host = testinfra.get_host("local://")
        assert [(e.address, e.port) for e in listeners(host, port)] == [("127.0.0.1", port)]
        assert server_pid(host, port) == os.getpid()


def test_runner_runs_only_launch_checks_with_a_timeout_covering_the_profile(tmp_path: Path) -> None:
    command = pytest_command("http://h:1", "prod", "standard", tmp_path, hosts=["ssh://a", "ssh://b"])
    assert command[command.index("-m", 3) + 1] == "launch"
    assert "--timeout=1800" in command  # 15 min sustained + margin
    assert command[command.index("--hosts") + 1] == "ssh://a,ssh://b"


SERVER_YAML = """service:
  host: 127.0.0.1
  api_keys_env: SPECDEPLOY_API_KEYS
  api_keys_file: /etc/specdeploy/api_keys
scheduler:
  max_batched_tokens: 1024
"""


def test_a_rendered_server_config_holds_no_secret() -> None:
    assert plaintext_secrets(SERVER_YAML) == []


def test_keys_written_into_a_config_file_are_found() -> None:
    assert plaintext_secrets(SERVER_YAML + "api_keys: ci:0123456789abcdef0123\n") == ["password, token or key value"]
    assert plaintext_secrets("ci:0123456789abcdef0123:60\n") == ["API key entry (id:key)"]
    assert plaintext_secrets("aws_access_key_id = AKIAABCDEFGHIJKLMNOP\n") == ["AWS access key id"]
    assert plaintext_secrets("password: hunter2hunter2\n") == ["password, token or key value"]
