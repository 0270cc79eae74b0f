"""The request path in one process (the app on a TestClient, the real engine on the tiny model): every check
runs exactly once per request, at its layer."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from serving.api import admit
from serving.api.settings import Settings
from serving.config import ServerConfig
from serving.engine.engine import LLMEngine
from serving.engine.model_runner import ModelRunner
from serving.engine.types import SamplingParams
from serving.main import create_app


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, model_store: str) -> Iterator[TestClient]:
    config = ServerConfig.model_validate({
        "service": {"served_model_name": "tiny", "weights_uri": model_store},
        "model": {"path": str(tmp_path_factory.mktemp("cache") / "tiny"), "dtype": "fp32", "device": "cpu",
                  "kv_cache_bytes": 4 * 2**20},
        "scheduler": {"max_input_len": 512, "max_output_len": 256, "max_batched_tokens": 512},
    })
    with TestClient(create_app(Settings(config=config))) as test_client:  # no API keys: auth is off
        deadline = time.monotonic() + 120
        while test_client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, test_client.get("/ready").text
            time.sleep(0.1)
        yield test_client


class Counter:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
        self.calls = 0
        original: Callable[..., Any] = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)


REQUESTS = [
    pytest.param("/v1/completions", {"prompt": "hello there", "max_tokens": 5}, id="completion"),
    pytest.param("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 5, "stream": True}, id="completion-stream"),
    pytest.param("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
                 id="chat"),
    pytest.param("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                                          "stream": True}, id="chat-stream"),
]


@pytest.mark.parametrize(("path", "body"), REQUESTS)
def test_each_check_runs_once_per_request(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, Any]
) -> None:
    engine_admission = Counter(monkeypatch, LLMEngine, "check_admission")
    validation = Counter(monkeypatch, SamplingParams, "validate")
    server_admission = Counter(monkeypatch, admit, "check_queue_wait")
    limits = Counter(monkeypatch, admit, "server_limits")
    response = client.post(path, json={"model": "tiny", **body})
    assert response.status_code == 200, response.text
    if body.get("stream"):
        assert response.text.rstrip().endswith("data: [DONE]")
    else:
        assert response.json()["usage"]["completion_tokens"] == 5
    assert (engine_admission.calls, validation.calls, server_admission.calls, limits.calls) == (1, 1, 1, 1)


def test_an_engine_refusal_is_mapped_once_and_nothing_runs(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    engine_admission = Counter(monkeypatch, LLMEngine, "check_admission")
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 99999], "max_tokens": 3})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_value"
    assert "token ids outside [0, 4096)" in response.json()["error"]["message"]
    assert engine_admission.calls == 1
    assert client.get("/ready").status_code == 200


@pytest.mark.parametrize("prompt", ["", [], [""], [[]]])
def test_an_empty_prompt_is_refused_by_the_schema(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, prompt: Any
) -> None:
    limits = Counter(monkeypatch, admit, "server_limits")
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt})
    assert response.status_code == 400
    assert response.json()["error"] == {"message": "prompt is empty", "type": "invalid_request_error",
                                        "param": "prompt", "code": "empty_prompt"}
    assert limits.calls == 0  # refused before the request path began


def test_the_routers_only_call_admit_run_respond() -> None:
    from serving.api.routes import chat, completions, responses

    for router in (chat, completions, responses):
        source = Path(router.__file__).read_text()
        assert "await admit_" in source and "run.start(" in source and "await respond." in source
        for check in ("server_limits", "check_admission", ".validate(", "prompt is empty", "encode"):
            assert check not in source, f"{router.__name__} checks {check} itself"


def _fail_next_steps(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """The engine's next `count` forward steps raise (as an out-of-memory on a rare shape would)."""
    original = ModelRunner.execute
    left = [count]

    def execute(self: ModelRunner, sched: Any, blocks: Any) -> Any:
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("injected step fault")
        return original(self, sched, blocks)

    monkeypatch.setattr(ModelRunner, "execute", execute)


def test_a_failed_engine_step_is_a_503_for_its_requests_and_the_server_stays_ready(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fail_next_steps(monkeypatch, 1)
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 5})
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "engine_step_failed" and "injected step fault" in error["message"]
    assert response.headers["retry-after"] == "1"
    assert client.get("/ready").status_code == 200 and client.get("/health").status_code == 200
    again = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 5})
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 5
    metrics = client.get("/metrics").text
    assert "specdeploy_engine_step_failures_total 1.0" in metrics


def test_a_failed_step_mid_stream_ends_the_stream_with_an_error_event(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = ModelRunner.execute
    calls = [0]

    def execute(self: ModelRunner, sched: Any, blocks: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:  # after the first tokens went out
            raise RuntimeError("injected step fault")
        return original(self, sched, blocks)

    monkeypatch.setattr(ModelRunner, "execute", execute)
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 20,
                                                     "ignore_eos": True, "stream": True})
    assert response.status_code == 200
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert len(events) >= 3 and '"engine_step_failed"' in events[-1], events[-3:]  # tokens, then the error
    assert client.get("/ready").status_code == 200
