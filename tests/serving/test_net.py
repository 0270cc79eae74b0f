"""free_port and wait_until_ready against a scripted /ready on loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import pytest

from serving.net import NotReady, free_port, wait_until_ready
from tests.loopback import loopback_http, reply_json


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


@pytest.fixture
def scripted_ready() -> Iterator[tuple[str, list[tuple[int, dict[str, object]]]]]:
    """A server whose GET /ready answers the next scripted (status, body); the last one repeats."""
    script: list[tuple[int, dict[str, object]]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            status, body = script.pop(0) if len(script) > 1 else script[0]
            reply_json(self, status, body)

        def log_message(self, *args: object) -> None:
            pass

    with loopback_http(Handler) as url:
        yield url, script


def _not_ready(phase: str, failed: bool = False) -> tuple[int, dict[str, object]]:
    return 503, {"status": "not_ready", "reason": f"not ready: {phase}", "phase": phase, "failed": failed}


def test_returns_once_ready_answers_200(scripted_ready: tuple[str, list]) -> None:
    base, script = scripted_ready
    script += [_not_ready("loading model"), _not_ready("warming up"), (200, {"status": "ready", "failed": False})]
    wait_until_ready(base, timeout_s=10, poll_s=0.01)
    assert len(script) == 1  # it asked until the 200


def test_a_failed_start_up_stops_the_wait_at_once(scripted_ready: tuple[str, list]) -> None:
    base, script = scripted_ready
    script.append((503, {"status": "not_ready", "reason": "weights verification failed: x", "failed": True}))
    with pytest.raises(NotReady, match="refused readiness: weights verification failed: x"):
        wait_until_ready(base, timeout_s=60, poll_s=0.01)


def test_time_out_names_the_last_reason(scripted_ready: tuple[str, list]) -> None:
    base, script = scripted_ready
    script.append(_not_ready("loading model"))
    with pytest.raises(NotReady, match="not ready after 0s: not ready: loading model"):
        wait_until_ready(base, timeout_s=0.2, poll_s=0.05)


def test_an_exited_process_stops_the_wait() -> None:
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    with pytest.raises(NotReady, match="exited with code 3"):
        wait_until_ready(f"http://127.0.0.1:{free_port()}", timeout_s=60, process=process)


def test_nothing_listening_times_out() -> None:
    with pytest.raises(NotReady, match="Connection refused"):
        wait_until_ready(f"http://127.0.0.1:{free_port()}", timeout_s=0.3, poll_s=0.05)
