"""A tiny OpenAI-style server with switchable faults, to prove the launch checks can fail
(fixture ``serve_fake(**faults)``).

Healthy, it passes the checks it is used with (so a failure is the fault's doing, not the fake's).
Faults: ``truncate`` (stops at half of max_tokens yet reports finish_reason "length"), ``leak``
(resident memory grows with every request), ``hold_kv`` (a disconnected stream keeps its KV blocks).
Standard library only, served from a thread.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from tests.loopback import loopback_http, reply_json

MODEL = "fake-model"
MAX_INPUT = 1536
MAX_OUTPUT = 256
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")


@dataclass
class Faults:
    truncate: bool = False
    leak: bool = False
    hold_kv: bool = False


@dataclass
class FakeState:
    faults: Faults
    rss: float = 200 * 2**20
    kv_used: int = 0
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _tokens(n: int) -> list[str]:
    return [f" {WORDS[i % len(WORDS)]}" for i in range(n)]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: FakeState  # set on the subclass made per server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (BaseHTTPRequestHandler's name)
        return

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        reply_json(self, status, payload)

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                      "code": None}})

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path in ("/health", "/ready"):
            self._json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        elif self.path == "/metrics":
            s = self.state
            text = (f"specdeploy_kv_blocks_used {s.kv_used}\nspecdeploy_process_resident_memory_bytes {s.rss}\n"
                    f"specdeploy_requests_waiting 0\nspecdeploy_requests_running 0\n"
                    f"specdeploy_requests_total{{endpoint=\"/v1/completions\",status=\"200\"}} {s.requests}\n"
                    # a speculating server whose guard runs 4 of every 5 decoding steps without drafts
                    f"specdeploy_spec_draft_tokens_total {8 * s.requests}\n"
                    f"specdeploy_spec_accepted_tokens_total {6 * s.requests}\n"
                    f"specdeploy_spec_guard_cycles_total {10 * s.requests}\n"
                    f"specdeploy_spec_guard_vetoed_cycles_total {8 * s.requests}\n")
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self._error(404, "no route")

    def do_POST(self) -> None:  # noqa: N802
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return self._error(400, "request body is not valid JSON")
        prompt = body.get("prompt") if "prompt" in body else body.get("messages")
        if not prompt:
            return self._error(400, "prompt is empty")
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        if prompt_tokens > MAX_INPUT:
            return self._error(400, f"prompt has {prompt_tokens} tokens; the maximum input length is {MAX_INPUT}")
        max_tokens = int(body.get("max_tokens") or 16)
        if max_tokens > MAX_OUTPUT:
            return self._error(400, f"max_tokens is {max_tokens}; the maximum output length is {MAX_OUTPUT}")
        s = self.state
        with s.lock:
            s.requests += 1
            if s.faults.leak:
                s.rss += 4 * 2**20
        produced = max_tokens // 2 if s.faults.truncate else max_tokens
        tokens = _tokens(produced)
        chat = "messages" in body
        if not body.get("stream"):
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": "".join(tokens)}
            else:
                choice["text"] = "".join(tokens)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": produced,
                     "total_tokens": prompt_tokens + produced}
            return self._json(200, {"id": "x", "object": "text_completion", "choices": [choice], "usage": usage})
        self._stream(tokens, chat, prompt_tokens)

    def _stream(self, tokens: list[str], chat: bool, prompt_tokens: int) -> None:
        s = self.state
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with s.lock:
            s.kv_used += 4
        finished = False
        try:
            for i, token in enumerate(tokens):
                last = i == len(tokens) - 1
                choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
                if chat:
                    choice["delta"] = {"content": token}
                else:
                    choice["text"] = token
                self._chunk({"choices": [choice]})
                time.sleep(0.002)
            self._chunk({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens)}})
            self._write(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            finished = True
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            if finished or not s.faults.hold_kv:
                with s.lock:
                    s.kv_used -= 4

    def _chunk(self, payload: dict[str, Any]) -> None:
        self._write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _write(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


@contextmanager
def fake_server(faults: Faults | None = None) -> Iterator[tuple[str, FakeState]]:
    """Serve on a free loopback port; yields (endpoint, state)."""
    state = FakeState(faults or Faults())
    with loopback_http(type("BoundHandler", (Handler,), {"state": state})) as url:
        yield url, state


@pytest.fixture
def serve_fake() -> Any:
    """``with serve_fake(truncate=True) as (endpoint, state): ...``"""

    def start(**faults: bool) -> Any:
        return fake_server(Faults(**faults))

    return start
