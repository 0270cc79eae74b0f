"""Issue 18: inputs that used to kill the engine loop, give a 500 or a wrong status (real server, loopback)."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest

from tests.serving.api.conftest import KEYS, MODEL_NAME, ServerProcess


def _is_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**63, 10**40])
def test_out_of_range_seed_is_a_400_and_the_engine_keeps_serving(server: ServerProcess, seed: int) -> None:
    with server.client() as client:
        bad = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "seed": seed})
        error = _is_openai_error(bad, 400)
        assert error["param"] == "seed"
        assert client.get("/health").status_code == 200
        assert client.get("/ready").status_code == 200
        ok = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "seed": 7})
        assert ok.status_code == 200, ok.text


def test_extreme_in_range_seeds_are_served(server: ServerProcess) -> None:
    with server.client() as client:
        for seed in (-(2**63), 2**63 - 1, 0):
            ok = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2,
                                                      "temperature": 1.0, "seed": seed})
            assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "a\ud800b", "max_tokens": 2}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": ["\udfff"], "max_tokens": 2}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "stop": ["\ud800"]}),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x\ud800"}],
                              "max_tokens": 2}),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "\udc00"}]}], "max_tokens": 2}),
])
def test_lone_surrogates_are_a_400(server: ServerProcess, path: str, body: dict[str, Any]) -> None:
    with server.client() as client:
        raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels escaped, as \ud800
        response = client.post(path, content=raw, headers={"content-type": "application/json"})
        error = _is_openai_error(response, 400)
        assert "surrogate" in error["message"] or "UTF-8" in error["message"], error


def test_raw_surrogate_bytes_are_a_400(server: ServerProcess) -> None:
    raw = b'{"model": "' + MODEL_NAME.encode() + b'", "prompt": "a\xed\xa0\x80b", "max_tokens": 2}'
    with server.client() as client:
        response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        _is_openai_error(response, 400)


def test_tiny_positive_temperature_is_greedy(server: ServerProcess) -> None:
    body = {"model": MODEL_NAME, "prompt": "The quick brown", "max_tokens": 12}
    with server.client() as client:
        greedy = client.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
        for temperature in (5e-324, 1e-300, 1e-30):
            got = client.post("/v1/completions", json={**body, "temperature": temperature, "seed": 3})
            assert got.status_code == 200, got.text
            assert got.json()["choices"][0]["text"] == greedy, temperature


def _raw_request(server: ServerProcess, payload: bytes, timeout: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(payload)
        chunks = []
        while True:
            data = sock.recv(65536)
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks)


def test_chunked_body_over_the_limit_is_a_413(server: ServerProcess) -> None:
    chunk = b"x" * 40000
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3)) + b"0\r\n\r\n"
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS['alice']}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n").encode()
    reply = _raw_request(server, head + body)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"request_too_large"' in reply


def test_empty_body_names_the_body(server: ServerProcess) -> None:
    with server.client() as client:
        response = client.post("/v1/completions", content=b"", headers={"content-type": "application/json"})
        error = _is_openai_error(response, 400)
        assert "None" not in error["message"] and "body" in error["message"], error


def test_negative_content_length_is_an_openai_error(server: ServerProcess) -> None:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS['alice']}\r\n"
            "Content-Type: application/json\r\nContent-Length: -5\r\nConnection: close\r\n\r\n").encode()
    reply = _raw_request(server, head)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert b'"error"' in reply and b"application/json" in reply.lower(), reply[:400]


def test_utf16_body_is_refused(server: ServerProcess) -> None:
    body = '{"model": "tiny", "prompt": "hi", "max_tokens": 2}'.encode("utf-16")
    with server.client() as client:
        response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        _is_openai_error(response, 400)


def test_openapi_is_served_behind_auth_and_documents_400(server: ServerProcess) -> None:
    with server.client(key=None) as anonymous:
        assert anonymous.get("/openapi.json").status_code == 401
    with server.client() as client:
        schema = client.get("/openapi.json").json()
    responses = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert "400" in responses and "422" not in responses


def test_a_prompt_too_long_in_characters_is_refused_before_tokenizing(server: ServerProcess) -> None:
    with server.client() as client:
        response = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "a" * 60000, "max_tokens": 2})
        error = _is_openai_error(response, 400)
        assert "60000 characters" in error["message"], error
        chat = client.post("/v1/chat/completions", json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "b" * 60000}], "max_tokens": 2})
        assert "characters" in _is_openai_error(chat, 400)["message"]
