"""Structured outputs and tool calling through the official `openai` client, against a real server (a random
tiny model: whatever it writes, the grammar makes it valid)."""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

MODEL_NAME = "tiny"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"]}}}


class Forecast(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    temperature_c: int = Field(ge=-40, le=50)
    raining: bool
    note: str = Field(max_length=8)


@pytest.fixture
def client(server: Any, api_keys: dict[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=api_keys["alice"], max_retries=0, timeout=60)


def parse(client: openai.OpenAI) -> Any:
    chat = client.chat.completions
    return chat.parse if hasattr(chat, "parse") else client.beta.chat.completions.parse


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_with_a_pydantic_model(client: openai.OpenAI, temperature: float) -> None:
    completion = parse(client)(model=MODEL_NAME, messages=[{"role": "user", "content": "Forecast for Oslo?"}],
                               response_format=Forecast, max_tokens=200, temperature=temperature, seed=3)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Forecast)


def test_json_object_and_json_schema_on_completions(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}},
              "required": ["ok", "n"]}
    out = client.completions.create(model=MODEL_NAME, prompt="x = ", max_tokens=60, temperature=0,
                                    extra_body={"response_format": {"type": "json_schema",
                                                                    "json_schema": {"name": "s", "schema": schema}}})
    jsonschema.validate(json.loads(out.choices[0].text), schema)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "JSON please"}],
                                          response_format={"type": "json_object"}, max_tokens=120, temperature=0)
    if chat.choices[0].finish_reason == "stop":  # an open object may run to the length limit
        assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
    else:
        assert (chat.choices[0].message.content or "").startswith("{")


def test_bad_schema_is_a_400_naming_the_problem(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match='response_format: .*Unsupported type "frobnicate"'):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {
                "type": "object", "properties": {"a": {"type": "frobnicate"}}}}})


def test_tool_calling_round_trip(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                           tool_choice="required", max_tokens=80, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    call = calls[0]
    arguments = json.loads(call.function.arguments)
    schema = (WEATHER_TOOL if call.function.name == "get_weather" else TIME_TOOL)["function"]["parameters"]
    jsonschema.validate(arguments, schema)  # type: ignore[arg-type]
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18})}]
    answer = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                            tool_choice="auto", max_tokens=8, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.usage is not None and answer.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore


def test_named_tool_choice_streams_the_call_as_tool_call_deltas_arguments_in_pieces(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80, temperature=0.7,
        seed=1, stream=True)
    deltas, content, finish = [], "", None
    for chunk in stream:
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and "<tool_call>" not in content
    assert [d.function.name for d in deltas if d.function and d.function.name] == ["get_weather"]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and {d.index for d in deltas} == {0}
    assert len(deltas) > 2  # the name first, then the arguments as they were generated (issue 37)
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    jsonschema.validate(json.loads(arguments), WEATHER_TOOL["function"]["parameters"])


def test_tool_choice_naming_an_unknown_function_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       tools=[WEATHER_TOOL],
                                       tool_choice={"type": "function", "function": {"name": "launch"}})


def test_every_choice_of_n_follows_the_schema(client: openai.OpenAI) -> None:
    completion = parse(client)(model=MODEL_NAME, messages=[{"role": "user", "content": "Two forecasts"}],
                               response_format=Forecast, max_tokens=200, temperature=1.0, n=3, seed=5)
    assert len(completion.choices) == 3
    assert all(isinstance(c.message.parsed, Forecast) for c in completion.choices)
