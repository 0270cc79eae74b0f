"""Issue 18: the server under faults, on loopback, bounded in time and count — slow clients, poison
requests during load, SIGKILL during streams (clients see EOF fast; a restart answers identically),
SIGTERM past the drain grace (error event and a clean end, 503 bodies, exit within grace + 1 s).
(SIGKILL during a weights pull: tests/serving/weights/test_pull_faults.py.)"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serving.api.conftest import KEYS, MODEL_NAME, ServerProcess
from tests.serving.chaos.conftest import serving

AUTH = f"Authorization: Bearer {KEYS['alice']}\r\n"


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """True (and what arrived) if the server closed the connection within ``seconds``."""
    sock.settimeout(seconds)
    received = b""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                return True, received
            received += data
    except TimeoutError:
        return False, received
    except ConnectionResetError:
        return True, received
    return False, received


@pytest.mark.slow
def test_slow_clients_are_cut_off_and_served_clients_are_not_starved(chaos_server: ServerProcess) -> None:
    port = chaos_server.port
    partial_headers = [_connect(port) for _ in range(30)]  # 30 > the cap of 20 unauthenticated
    for sock in partial_headers:
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        except OSError:
            pass  # refused at once by the cap
    short_body = _connect(port)
    short_body.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + AUTH +
                        "Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"model\":").encode())
    started = time.monotonic()
    with chaos_server.client() as client:  # a well-behaved client is served meanwhile
        health = client.get("/health")
        ok = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4})
    assert health.status_code == 200 and ok.status_code == 200, ok.text
    outcomes = [_closed_within(sock, 3.0) for sock in partial_headers]
    closed = sum(1 for done, _ in outcomes if done)
    assert closed == 30, f"{30 - closed} slow connections still open"
    done, reply = _closed_within(short_body, 3.0)
    assert done and reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b'"body_timeout"' in reply
    assert time.monotonic() - started < 8
    for sock in [*partial_headers, short_body]:
        sock.close()


@pytest.mark.slow
def test_an_idle_keep_alive_connection_lasts_keep_alive_s_not_the_header_timeout(
        tmp_path: Path, model_store: str) -> None:
    """What a load balancer that reuses connections relies on: after a response, an idle connection stays open
    for service.keep_alive_s (here 4 s, past the 1 s header timeout), then the server closes it."""
    env = {"SPECDEPLOY__SERVICE__HEADER_TIMEOUT_S": "1", "SPECDEPLOY__SERVICE__KEEP_ALIVE_S": "4"}
    for server in serving(tmp_path, model_store, env=env):
        sock = _connect(server.port)
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\n{AUTH}\r\n".encode())
        closed, reply = _closed_within(sock, 2.5)  # the response, then 2.5 s idle: past the header timeout
        assert reply.startswith(b"HTTP/1.1 200") and not closed, (closed, reply[:200])
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\n{AUTH}\r\n".encode())  # reused: served
        answered = time.monotonic()
        closed, reply = _closed_within(sock, 1.0)
        assert reply.startswith(b"HTTP/1.1 200") and not closed, (closed, reply[:200])
        closed, _ = _closed_within(sock, 8.0)  # idle again: closed once keep_alive_s has passed
        idle_s = time.monotonic() - answered
        assert closed and 3.5 < idle_s < 7.0, idle_s
        sock.close()


POISON: list[tuple[str, dict[str, Any] | bytes]] = [
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "seed": 18446744073709551616}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "seed": -9223372036854775809}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "a\ud800", "max_tokens": 2}),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "\udfff"}]}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "temperature": 5e-324, "max_tokens": 2}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [10**30], "max_tokens": 2}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [-1], "max_tokens": 2}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x" * 60000}),
    ("/v1/completions", b'{"model": "tiny", "prompt": "a\xed\xa0\x80"}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "hi"}'.encode("utf-16")),
    ("/v1/completions", b"{" * 5000),
    ("/v1/completions", b""),
]


@pytest.mark.slow
def test_poison_requests_during_load_fail_alone(chaos_server: ServerProcess) -> None:
    results: list[tuple[int, str | None]] = []

    def stream() -> None:
        with chaos_server.client() as client, client.stream("POST", "/v1/completions", json={
                "model": MODEL_NAME, "prompt": "load", "max_tokens": 300, "ignore_eos": True, "stream": True,
                "temperature": 0}) as response:
            finish = None
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
            results.append((response.status_code, finish))

    workers = [threading.Thread(target=stream) for _ in range(4)]
    for worker in workers:
        worker.start()
    time.sleep(0.3)
    statuses: list[int] = []
    with chaos_server.client() as client:
        for path, body in POISON:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = client.post(path, content=raw, headers={"content-type": "application/json"})
            statuses.append(response.status_code)
            assert response.status_code < 500, (body if isinstance(body, dict) else body[:40], response.text)
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        for worker in workers:
            worker.join(timeout=60)
        assert statuses.count(200) == 1, statuses  # only the denormal temperature (served greedy) succeeds
        assert results == [(200, "length")] * 4, results
        assert client.get("/ready").status_code == 200
        assert chaos_server.metric("specdeploy_kv_blocks_used") == 0


def _greedy(server: ServerProcess) -> str:
    with server.client() as client:
        response = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Once upon a time",
                                                        "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["text"])


@pytest.mark.slow
def test_sigkill_during_streams_gives_clients_eof_and_a_restart_answers_identically(
        tmp_path: Path, model_store: str) -> None:
    workdir = tmp_path / "killed"
    workdir.mkdir()
    server = ServerProcess(workdir, model_store)
    server.wait_ready()
    before = _greedy(server)
    ended: list[float] = []
    started = threading.Barrier(5)

    def stream() -> None:
        try:
            with server.client() as client, client.stream("POST", "/v1/completions", json={
                    "model": MODEL_NAME, "prompt": "x", "max_tokens": 1000, "ignore_eos": True,
                    "stream": True}) as response:
                lines = response.iter_lines()
                next(lines)
                started.wait(timeout=30)
                for _ in lines:
                    pass
        except httpx.HTTPError:
            pass
        ended.append(time.monotonic())

    workers = [threading.Thread(target=stream) for _ in range(4)]
    for worker in workers:
        worker.start()
    started.wait(timeout=30)
    killed_at = time.monotonic()
    server.proc.send_signal(signal.SIGKILL)
    for worker in workers:
        worker.join(timeout=10)
    server.proc.wait(timeout=10)
    server.log.close()
    assert len(ended) == 4 and max(ended) - killed_at < 2.0, [round(t - killed_at, 2) for t in ended]
    restarted = ServerProcess(workdir, model_store)  # same weights cache: verified, not pulled
    try:
        restarted.wait_ready()
        assert _greedy(restarted) == before
    finally:
        restarted.stop()


@pytest.mark.slow
def test_drain_past_the_grace_period_keeps_its_contract(tmp_path: Path, model_store: str) -> None:
    grace = 1.0
    server = ServerProcess(tmp_path, model_store, overrides={
        "service": {"drain_grace_s": grace},
        "scheduler": {"max_output_len": 2000, "max_input_len": 16},
        "model": {"max_model_len": 2048},
    })
    server.wait_ready()
    streamed: list[list[str]] = []
    whole: list[httpx.Response] = []
    running = threading.Barrier(3)
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2000, "ignore_eos": True}

    def stream() -> None:
        with server.client() as client, client.stream("POST", "/v1/completions",
                                                      json={**body, "stream": True}) as response:
            lines = response.iter_lines()
            events = [next(lines)]
            running.wait(timeout=30)
            events += [line for line in lines if line]  # raises if the chunked body is cut
            streamed.append(events)

    def non_stream() -> None:
        with server.client() as client:
            running.wait(timeout=30)
            whole.append(client.post("/v1/completions", json=body))

    workers = [threading.Thread(target=stream), threading.Thread(target=non_stream)]
    for worker in workers:
        worker.start()
    running.wait(timeout=30)
    time.sleep(0.2)
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(timeout=grace + 10)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        raise
    exit_s = time.monotonic() - signalled
    for worker in workers:
        worker.join(timeout=10)
    server.log.close()
    log = server.log_path.read_text(errors="replace")
    assert server.proc.returncode == 0
    assert exit_s <= grace + 1.0, f"exited {exit_s:.2f}s after SIGTERM (grace {grace}s)"
    assert len(streamed) == 1, "the stream was cut without a clean end"
    last = json.loads(streamed[0][-1].removeprefix("data: "))
    assert last["error"]["code"] == "aborted", streamed[0][-3:]
    assert len(whole) == 1 and whole[0].status_code == 503 and whole[0].json()["error"]["code"] == "aborted"
    assert "Traceback" not in log and "already running" not in log, log[-2000:]
