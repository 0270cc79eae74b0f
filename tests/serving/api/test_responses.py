"""POST /v1/responses through the official `openai` client (responses.create, streamed, responses.parse, a
function-tool round trip) against the real server, and its errors. A random tiny model: what it writes is noise,
but the grammar makes a schema's or a forced call's output valid."""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

MODEL_NAME = "tiny"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}


class Forecast(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    temperature_c: int = Field(ge=-40, le=50)
    raining: bool


@pytest.fixture
def client(server: Any, api_keys: dict[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=api_keys["alice"], max_retries=0, timeout=60)


def test_create_answers_what_chat_completions_answers(client: openai.OpenAI) -> None:
    """One request path: the same conversation, greedy, gives the same text through both APIs."""
    response = client.responses.create(model=MODEL_NAME, instructions="Be brief.", input="Say hello.",
                                       max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}])
    assert response.object == "response" and response.output[0].type == "message"
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                           chat.usage.completion_tokens)
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete" and response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"


def test_streamed_events_come_in_order_and_add_up_to_the_response(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL_NAME, input="Tell me a story.", max_output_tokens=20,
                                    temperature=0)
    events = list(client.responses.create(model=MODEL_NAME, input="Tell me a story.", max_output_tokens=20,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text  # type: ignore[union-attr]
    assert kinds.count("response.output_text.delta") > 1


def test_parse_returns_the_schema_instance(client: openai.OpenAI) -> None:
    response = client.responses.parse(model=MODEL_NAME, input="The forecast for Oslo", text_format=Forecast,
                                      max_output_tokens=120, temperature=1.0)
    assert isinstance(response.output_parsed, Forecast)


def test_a_function_tool_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL_NAME, input="Weather in Paris?", tools=[WEATHER],  # type: ignore[list-item]
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
                                    temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])  # type: ignore[arg-type]
    follow_up: list[Any] = [{"role": "user", "content": "Weather in Paris?"}, *first.output,
                            {"type": "function_call_output", "call_id": calls[0].call_id,
                             "output": json.dumps({"temperature_c": 18})}]
    second = client.responses.create(model=MODEL_NAME, input=follow_up, tools=[WEATHER],  # type: ignore[list-item]
                                     tool_choice="auto", max_output_tokens=8, temperature=0)
    assert second.output_text and not [i for i in second.output if i.type == "function_call"]
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its result are in the prompt


def test_a_streamed_function_call_sends_its_arguments_in_pieces(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL_NAME, input="Weather?", tools=[WEATHER],  # type: ignore[list-item]
                                          tool_choice="required", max_output_tokens=60, temperature=0.7, stream=True))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"] and added[0].item.name == "get_weather"  # type: ignore
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]  # type: ignore
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(pieces) > 1 and len(done) == 1 and "".join(pieces) == done[0].arguments  # type: ignore
    jsonschema.validate(json.loads("".join(pieces)), WEATHER["parameters"])  # type: ignore[arg-type]
    final = events[-1].response  # type: ignore[union-attr]
    assert [i.type for i in final.output] == ["function_call"]


def test_responses_count_in_the_metrics_and_need_a_key(server: Any) -> None:
    def served() -> float:
        for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
            if line.startswith('specdeploy_requests_total{endpoint="/v1/responses",status="200"}'):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = served()
    with server.client() as c:
        assert c.post("/v1/responses", json={"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2}
                      ).status_code == 200
    assert served() == before + 1
    with server.client(key=None) as c:
        assert c.post("/v1/responses", json={"model": MODEL_NAME, "input": "hi"}).status_code == 401


REFUSED = [
    ({"previous_response_id": "resp_123"}, "previous_response_id", "stores no responses"),
    ({"conversation": "conv_1"}, "conversation", "stores no responses"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation", "moderation is not supported"),
    ({"background": True}, "background", "background is not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools", "tool type 'web_search' is not supported"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice", "tool_choice"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "type 'reasoning'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input"),
    ({"truncation": "auto"}, "truncation", "never drops input"),
    ({"input": ""}, "input", "input is empty"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "needs a schema"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format",
     "cannot be combined"),
    # chat's limits and checks, named as this API names the fields
    ({"max_output_tokens": 5000}, "max_output_tokens", "max_output_tokens is 5000; the maximum output length is"),
    ({"input": "word " * 600}, "input", "input has"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frobnicate"}}}}, "text.format",
     "text.format: unsupported or invalid JSON schema"),
]


@pytest.mark.parametrize(("fields", "param", "text"), REFUSED, ids=[r[1] + "-" + str(i) for i, r in enumerate(REFUSED)])
def test_what_the_server_cannot_honour_is_a_400_naming_the_field(server: Any, fields: dict[str, Any], param: str,
                                                                 text: str) -> None:
    with server.client() as c:
        response = c.post("/v1/responses", json={"model": MODEL_NAME, "input": "hi", **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and text in error["message"], error


def test_chat_refuses_moderation_and_names_tool_choice(server: Any) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with server.client() as c:
        moderation = c.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages,
                                                          "moderation": {"model": "omni-moderation-latest"}})
        choice = c.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages,
                                                      "tools": [{"type": "function", "function": {"name": "f"}}],
                                                      "tool_choice": {"type": "allowed_tools", "tools": []}})
    assert moderation.status_code == 400 and moderation.json()["error"]["param"] == "moderation"
    assert "moderation is not supported" in moderation.json()["error"]["message"]
    assert choice.status_code == 400 and choice.json()["error"]["param"] == "tool_choice", choice.text
    assert choice.json()["error"]["message"].startswith("tool_choice: must be")


def test_output_text_logprobs_when_included(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=5, temperature=0,
                                       include=["message.output_text.logprobs"], top_logprobs=2)
    part = response.output[0].content[0]  # type: ignore[union-attr]
    assert response.usage is not None and len(part.logprobs) == response.usage.output_tokens  # type: ignore
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)  # type: ignore[union-attr]
