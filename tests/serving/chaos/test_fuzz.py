"""Issue 18: fuzz the served API from its own OpenAPI schema (/openapi.json, behind auth) with hypothesis.
Bounded (a fixed number of examples, about a minute on a 2-core machine); the property: no 5xx, every
4xx in OpenAI's error shape, the engine still ready afterwards. The inputs that once killed the engine or
gave a 500 are explicit examples."""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.serving.api.conftest import MODEL_NAME, ServerProcess

FUZZ_EXAMPLES = 500  # per endpoint: about a minute in all
_counts: Counter[str] = Counter()

# values no schema would suggest but clients send: int64 edges, denormals, surrogates, junk types
_NASTY = st.sampled_from([
    2**64, 2**63, -(2**63) - 1, 10**40, -1, 0, 5e-324, 1e308, -0.0, "\ud800", "\udfff", "", "\x00", "a" * 5000,
    None, True, [], {}, [[]], [None], {"type": "text"},
])


def _resolve(schema: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _from_schema(schema: dict[str, Any], spec: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """Values of the schema's type (bounds ignored on purpose: out-of-range is the point), mixed with junk."""
    schema = _resolve(schema, spec)
    options: list[st.SearchStrategy[Any]] = [_NASTY]
    for alternative in schema.get("anyOf", []) + schema.get("oneOf", []):
        options.append(_from_schema(alternative, spec, depth + 1))
    kind = schema.get("type")
    if "enum" in schema:
        options.append(st.sampled_from(schema["enum"]))
    if "const" in schema:
        options.append(st.just(schema["const"]))
    if kind == "string":
        options.append(st.text(max_size=40))
    elif kind == "integer":
        options.append(st.integers(min_value=-(2**70), max_value=2**70))
    elif kind == "number":
        options.append(st.floats(allow_nan=False, allow_infinity=False))
    elif kind == "boolean":
        options.append(st.booleans())
    elif kind == "array" and depth < 3:
        options.append(st.lists(_from_schema(schema.get("items", {}), spec, depth + 1), max_size=3))
    elif kind == "object" and depth < 3 and "properties" in schema:
        options.append(_object(schema, spec, depth + 1))
    return st.one_of(options)


def _object(schema: dict[str, Any], spec: dict[str, Any], depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    properties = schema.get("properties", {})
    required = set(schema.get("required", []))
    return st.fixed_dictionaries(
        {name: _from_schema(sub, spec, depth) for name, sub in properties.items() if name in required},
        optional={name: _from_schema(sub, spec, depth) for name, sub in properties.items() if name not in required},
    )


def _bodies(schema: dict[str, Any], spec: dict[str, Any], valid: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Whole fuzzed bodies, and a valid body with a few fuzzed fields (so many requests reach the engine)."""
    tweaks = st.fixed_dictionaries({}, optional={name: _from_schema(sub, spec, 1)
                                                 for name, sub in schema.get("properties", {}).items()})
    return st.one_of(_object(schema, spec), tweaks.map(lambda t: {**valid, **t}))


@pytest.fixture(scope="module")
def spec(chaos_server: ServerProcess) -> dict[str, Any]:
    with chaos_server.client() as client:
        response = client.get("/openapi.json")
    assert response.status_code == 200, response.text
    return dict(response.json())


def _body_schema(spec: dict[str, Any], path: str) -> dict[str, Any]:
    content = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return _resolve(content, spec)


def _check(server: ServerProcess, client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    if isinstance(body.get("model"), str) and body["model"]:
        body = {**body, "model": MODEL_NAME}  # reach the engine instead of stopping at the 404
    for key in ("max_tokens", "max_completion_tokens"):  # keep accepted requests short
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > 8:
            body[key] = 8
    if "max_tokens" not in body:
        body["max_tokens"] = 4
    raw = json.dumps(body, allow_nan=False).encode()  # ensure_ascii: surrogates travel as \\udXXX escapes
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    _counts["requests"] += 1
    _counts[f"{response.status_code // 100}xx"] += 1
    assert response.status_code < 500, (body, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]
    elif body.get("stream") is True:
        assert response.text.rstrip().endswith(("data: [DONE]", "}")), response.text[-200:]


@pytest.mark.slow
def test_fuzz_completions_from_the_served_schema(chaos_server: ServerProcess, spec: dict[str, Any],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    schema = _body_schema(spec, "/v1/completions")
    with chaos_server.client(timeout=30) as client:

        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(_bodies(schema, spec, {"model": MODEL_NAME, "prompt": "hello"}))
        @example({"model": MODEL_NAME, "prompt": "hi", "seed": 18446744073709551616})
        @example({"model": MODEL_NAME, "prompt": "hi", "seed": -9223372036854775809})
        @example({"model": MODEL_NAME, "prompt": "\ud800"})
        @example({"model": MODEL_NAME, "prompt": "hi", "stop": ["\udfff"]})
        @example({"model": MODEL_NAME, "prompt": "hi", "temperature": 5e-324})
        @example({"model": MODEL_NAME, "prompt": [2**70]})
        def run(body: dict[str, Any]) -> None:
            _check(chaos_server, client, "/v1/completions", body)

        run()
        assert client.get("/ready").status_code == 200
    with capsys.disabled():  # the counts belong in the CI log
        sys.stdout.write(f"\nfuzz /v1/completions: {dict(_counts)}\n")


@pytest.mark.slow
def test_fuzz_chat_from_the_served_schema(chaos_server: ServerProcess, spec: dict[str, Any],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    schema = _body_schema(spec, "/v1/chat/completions")
    with chaos_server.client(timeout=30) as client:

        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(_bodies(schema, spec, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}]}))
        @example({"model": MODEL_NAME, "messages": [{"role": "user", "content": "\ud800"}], "seed": 2**64})
        @example({"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]})
        @example({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "seed": -(2**63) - 1})
        def run(body: dict[str, Any]) -> None:
            _check(chaos_server, client, "/v1/chat/completions", body)

        run()
        assert client.get("/ready").status_code == 200
        assert chaos_server.metric("specdeploy_kv_blocks_used") == 0
    with capsys.disabled():
        sys.stdout.write(f"\nfuzz total (both endpoints): {dict(_counts)}\n")
    assert _counts["5xx"] == 0 and _counts["requests"] >= 2 * FUZZ_EXAMPLES

