"""The official `openai` client, unchanged, against a real server on loopback."""

from __future__ import annotations

from typing import Any

import openai
import pytest

MODEL_NAME = "tiny"


@pytest.fixture
def client(server: Any, api_keys: dict[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=api_keys["alice"], max_retries=0, timeout=60)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL_NAME]


def test_chat_completion(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert response.usage is not None
    assert response.usage.completion_tokens <= 8
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_completion(client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL_NAME, prompt="def add(a, b):", max_tokens=6, temperature=0)
    assert response.choices[0].text
    assert response.usage is not None and response.usage.completion_tokens <= 6


def test_streamed_chat_equals_non_streamed_for_greedy(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Write a loop"}], max_tokens=24,
                  temperature=0)
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                 **kwargs))  # type: ignore[call-overload]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_streamed_completion_equals_non_streamed_for_greedy(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="import os\n", max_tokens=24, temperature=0)
    whole = client.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(client.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="class ", max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    first = client.completions.create(**kwargs)  # type: ignore[call-overload]
    second = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert first.choices[0].text == second.choices[0].text


def test_stop_string_is_cut_from_the_text(client: openai.OpenAI) -> None:
    free = client.completions.create(model=MODEL_NAME, prompt="x = ", max_tokens=16, temperature=0)
    text = free.choices[0].text
    stop = text[len(text) // 2 :][:2]
    if not stop.strip():
        pytest.skip("greedy text has no usable stop string")
    stopped = client.completions.create(model=MODEL_NAME, prompt="x = ", max_tokens=16, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text
    assert text.startswith(stopped.choices[0].text)


def test_logprobs_are_returned(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = response.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == response.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(item.top_logprobs) == 2 and item.logprob <= 0 for item in content)
