"""Every error a client can cause: status, OpenAI error JSON, and the server still ready afterwards."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


def _long_prompt(tokens: int) -> list[int]:
    return [5 + (i % 200) for i in range(tokens)]


CASES: list[tuple[str, str, dict[str, Any], int, str]] = [
    # id, path, request kwargs, status, text the message must contain
    ("invalid-json", CHAT, {"content": b'{"model": "tiny", "messages": [', "headers": {"content-type":
                                                                                  "application/json"}},
     400, "not valid JSON"),
    ("invalid-utf8", COMPLETIONS, {"content": b'{"model": "tiny", "prompt": "\xff\xfe"}',
                                   "headers": {"content-type": "application/json"}}, 400, "JSON"),
    ("missing-messages", CHAT, {"json": {"model": "tiny"}}, 400, "messages"),
    ("empty-messages", CHAT, {"json": {"model": "tiny", "messages": []}}, 400, "messages"),
    ("empty-prompt", COMPLETIONS, {"json": {"model": "tiny", "prompt": ""}}, 400, "prompt is empty"),
    ("empty-token-prompt", COMPLETIONS, {"json": {"model": "tiny", "prompt": []}}, 400, "prompt is empty"),
    ("prompt-over-max-input", COMPLETIONS, {"json": {"model": "tiny", "prompt": _long_prompt(600)}}, 400,
     "prompt has 600 tokens; the maximum input length is 512"),
    ("max-tokens-over-max-output", COMPLETIONS, {"json": {"model": "tiny", "prompt": "a", "max_tokens": 5000}},
     400, "max_tokens is 5000; the maximum output length is 1024"),
    ("prompt-plus-output-over-context", COMPLETIONS,
     {"json": {"model": "tiny", "prompt": _long_prompt(500), "max_tokens": 1000}}, 400,
     "prompt (500 tokens) + max_tokens (1000) = 1500 exceeds the context length 1100"),
    ("negative-temperature", CHAT, {"json": {"model": "tiny", "messages": MSG, "temperature": -1}}, 400,
     "temperature"),
    ("top-p-zero", CHAT, {"json": {"model": "tiny", "messages": MSG, "top_p": 0}}, 400, "top_p"),
    ("n-over-max", CHAT, {"json": {"model": "tiny", "messages": MSG, "n": 17}}, 400, "n: "),
    ("too-many-prompts", COMPLETIONS, {"json": {"model": "tiny", "prompt": [[5, 6]] * 33}}, 400,
     "at most 32 prompts"),
    ("prompts-times-n-too-many", COMPLETIONS, {"json": {"model": "tiny", "prompt": ["a"] * 5, "n": 16}}, 400,
     "prompts x (best_of or n) = 80 engine requests"),
    ("best-of-below-n", COMPLETIONS, {"json": {"model": "tiny", "prompt": "a", "n": 3, "best_of": 2}}, 400,
     "best_of (2) must be at least n (3)"),
    ("best-of-streamed", COMPLETIONS, {"json": {"model": "tiny", "prompt": "a", "best_of": 2, "stream": True}},
     400, "best_of cannot be used with stream"),
    ("penalty-out-of-range", CHAT, {"json": {"model": "tiny", "messages": MSG, "presence_penalty": 2.5}}, 400,
     "presence_penalty"),
    ("logit-bias-not-a-token-id", CHAT, {"json": {"model": "tiny", "messages": MSG, "logit_bias": {"a": 1}}},
     400, "logit_bias"),
    ("logit-bias-out-of-range", COMPLETIONS, {"json": {"model": "tiny", "prompt": "a", "logit_bias": {"5": 101}}},
     400, "between -100 and 100"),
    ("logit-bias-outside-vocab", COMPLETIONS,
     {"json": {"model": "tiny", "prompt": "a", "logit_bias": {"99999": 1}}}, 400, "logit_bias has token ids"),
    # meaning-changing fields the server does not honour: refused naming the field, never silently dropped
    ("suffix", COMPLETIONS, {"json": {"model": "tiny", "prompt": "a", "suffix": "b"}}, 400,
     "suffix is not supported"),
    ("audio", CHAT, {"json": {"model": "tiny", "messages": MSG, "audio": {"voice": "alloy", "format": "wav"}}},
     400, "audio is not supported"),
    ("modalities-audio", CHAT, {"json": {"model": "tiny", "messages": MSG, "modalities": ["text", "audio"]}},
     400, "modalities is not supported"),
    ("functions", CHAT, {"json": {"model": "tiny", "messages": MSG,
                                  "functions": [{"name": "f", "parameters": {"type": "object"}}]}}, 400,
     "functions is not supported"),
    ("function-call", CHAT, {"json": {"model": "tiny", "messages": MSG, "function_call": "auto"}}, 400,
     "function_call is not supported"),
    ("prediction", CHAT, {"json": {"model": "tiny", "messages": MSG,
                                   "prediction": {"type": "content", "content": "x"}}}, 400,
     "prediction is not supported"),
    ("image-content-part", CHAT, {"json": {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}}, 400, "messages"),
    ("web-search-options", CHAT, {"json": {"model": "tiny", "messages": MSG, "web_search_options": {}}}, 400,
     "web_search_options is not supported"),
    ("too-many-stops", COMPLETIONS, {"json": {"model": "tiny", "prompt": "a", "stop": ["a", "b", "c", "d", "e"]}},
     400, "at most 4"),
    ("max-tokens-zero-without-echo", COMPLETIONS, {"json": {"model": "tiny", "prompt": "a", "max_tokens": 0}},
     400, "max_tokens=0 generates nothing; it needs echo=true"),
    ("bad-role", CHAT, {"json": {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}}, 400,
     "role"),
    ("token-id-out-of-vocab", COMPLETIONS, {"json": {"model": "tiny", "prompt": [1, 99999]}}, 400, "token ids"),
    ("stream-options-without-stream", CHAT,
     {"json": {"model": "tiny", "messages": MSG, "stream_options": {"include_usage": True}}}, 400,
     "stream_options"),
    ("unknown-model", CHAT, {"json": {"model": "gpt-5", "messages": MSG}}, 404, "'gpt-5' does not exist"),
    ("body-too-large", COMPLETIONS, {"json": {"model": "tiny", "prompt": "x" * 70000}}, 413, "exceeds 65536"),
    ("unknown-route", "/v1/embeddings", {"json": {}}, 404, "no route"),
]


@pytest.mark.parametrize(("path", "kwargs", "status", "text"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_gets_openai_error_and_server_stays_ready(
    server: Any, path: str, kwargs: dict[str, Any], status: int, text: str
) -> None:
    with server.client() as client:
        response = client.post(path, **kwargs)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert text in error["message"]
        assert client.get("/ready").status_code == 200


def test_missing_key_is_401(server: Any) -> None:
    with server.client(key=None) as client:
        response = client.post(CHAT, json={"model": "tiny", "messages": MSG})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "missing_api_key"
    assert httpx.get(f"{server.base_url}/ready").status_code == 200


def test_wrong_key_is_401_and_the_key_is_not_echoed(server: Any) -> None:
    with server.client(key="not-a-valid-key-123456") as client:
        response = client.get("/v1/models")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert "not-a-valid-key" not in response.text
    assert httpx.get(f"{server.base_url}/ready").status_code == 200


def test_health_and_ready_need_no_key(server: Any) -> None:
    with server.client(key=None) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/ready").json() == {"status": "ready", "reason": "ready", "phase": "ready", "failed": False}
        assert client.get("/metrics").status_code == 200  # metrics_require_auth is false here


def test_per_key_rate_limit_is_429_with_retry_after(server: Any, api_keys: dict[str, str]) -> None:
    statuses = []
    with server.client(key=api_keys["slow"]) as client:
        for _ in range(3):
            response = client.get("/v1/models")
            statuses.append(response.status_code)
    assert statuses == [200, 200, 429]
    assert int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["type"] == "rate_limit_error"
    with server.client(key=api_keys["bob"]) as other:  # other keys are not affected
        assert other.get("/v1/models").status_code == 200
        assert other.get("/ready").status_code == 200


def test_access_log_has_one_line_per_request_with_key_id_never_the_key(server: Any, api_keys: dict[str, str]) -> None:
    with server.client(key=api_keys["bob"], timeout=30) as client:
        response = client.post(COMPLETIONS, json={"model": "tiny", "prompt": "abc", "max_tokens": 3})
    request_id = response.headers["x-request-id"]
    log = server.log_text()
    for secret in api_keys.values():
        assert secret not in log
    lines = [line for line in log.splitlines() if request_id in line and "specdeploy.access" in line]
    assert len(lines) == 1
    record = json.loads(lines[0].split("specdeploy.access: ", 1)[1])
    assert record["key_id"] == "bob"
    assert record["status"] == 200
    assert record["prompt_tokens"] > 0 and record["completion_tokens"] == 3
    assert record["ttft_s"] > 0 and record["latency_s"] >= record["ttft_s"]


def test_streaming_error_statuses_come_before_the_stream(server: Any) -> None:
    with server.client() as client:
        response = client.post(CHAT, json={"model": "tiny", "messages": MSG, "stream": True, "max_tokens": 5000})
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")


def test_timeout_is_504_and_frees_blocks(small_server: Any) -> None:
    with small_server.client() as client:
        # top-5 logprobs of every token: more work per token, so 1500 of them cannot fit in the timeout
        response = client.post(COMPLETIONS, json={"model": "tiny", "prompt": "a", "max_tokens": 1500,
                                                  "ignore_eos": True, "logprobs": 5})
        assert response.status_code == 504, response.text
        assert response.json()["error"]["code"] == "request_timeout"
        assert client.get("/ready").status_code == 200
    assert small_server.metric("specdeploy_kv_blocks_used") == 0


def test_never_fitting_request_via_httpx_is_400_not_500(server: Any) -> None:
    with server.client() as client:
        response = client.post(COMPLETIONS, content=b"[1, 2, 3]", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_request_id_header_is_echoed(server: Any) -> None:
    with server.client() as client:
        response = client.get("/health", headers={"x-request-id": "trace-123"})
    assert response.headers["x-request-id"] == "trace-123"


def test_unsupported_method_is_405_in_openai_shape(server: Any) -> None:
    with server.client() as client:
        response = client.get(CHAT)
    assert response.status_code == 405
    assert "error" in response.json()


def test_ready_reports_the_phase_shape(server: Any) -> None:
    response = httpx.get(f"{server.base_url}/ready")
    assert response.json()["status"] == "ready"
