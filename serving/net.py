"""Loopback helpers shared by the server's benchmarks, the launch validation, the local platform and
the tests: a free port to bind, and waiting for a server's GET /ready.

Standard library only, so every install (the bare CLI included) can use them.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any


class NotReady(RuntimeError):
    """The server did not become ready: its process exited, start-up failed for good, or time ran out."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it; another process may take it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def read_ready(base_url: str, path: str = "/ready", timeout_s: float = 2.0) -> tuple[int, dict[str, Any]]:
    """GET the readiness endpoint: (HTTP status, JSON body); the body is empty when it is not JSON."""
    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}{path}", timeout=timeout_s) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        body = json.loads(raw)
    except ValueError:
        body = {}
    return status, body if isinstance(body, dict) else {}


def wait_until_ready(base_url: str, timeout_s: float, process: subprocess.Popen[bytes] | None = None,
                     path: str = "/ready", poll_s: float = 0.25) -> None:
    """Poll ``path`` until it answers 200.

    Raises :class:`NotReady` at once when ``process`` exits or the body says start-up ``failed``
    (the server stays up but will never become ready), else when ``timeout_s`` runs out; the message
    carries the last reason the server gave.
    """
    deadline = time.monotonic() + timeout_s
    reason = "no answer"
    while True:
        if process is not None and process.poll() is not None:
            raise NotReady(f"server exited with code {process.returncode} before becoming ready ({reason})")
        try:
            status, body = read_ready(base_url, path)
        except urllib.error.URLError as exc:  # refused while the server starts
            reason = str(exc.reason)
        except OSError as exc:  # reset or timed out
            reason = f"{type(exc).__name__}: {exc}"
        else:
            if status == 200:
                return
            reason = str(body.get("reason") or f"{path} answered {status}")
            if body.get("failed"):
                raise NotReady(f"server refused readiness: {reason}")
        if time.monotonic() >= deadline:
            raise NotReady(f"{base_url} not ready after {timeout_s:.0f}s: {reason}")
        time.sleep(poll_s)
