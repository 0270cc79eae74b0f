"""Tool calls parsed out of text (whole and streamed), the template fallback, and the request fields."""

from __future__ import annotations

import json
import random

import pytest
from pydantic import ValidationError

from serving.api.admit import fallback_messages, grammar_spec
from serving.api.render.tool_calls import ToolCallStream, parse_tool_calls
from serving.api.schemas import ChatCompletionRequest

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_whole_output_splits_into_content_and_calls() -> None:
    content, calls = parse_tool_calls("Let me check. " + CALL + CALL.replace("Paris", "Rome"))
    assert content == "Let me check. "
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)
    assert parse_tool_calls(CALL)[0] is None  # nothing but calls: content is null, as OpenAI sends it


def test_text_that_is_not_a_call_stays_text() -> None:
    text = "a <tool_call>not json</tool_call> b <tool"
    assert parse_tool_calls(text) == (text, [])


@pytest.mark.parametrize("seed", range(20))
def test_streamed_calls_are_found_whatever_the_chunk_boundaries(seed: int) -> None:
    text = "Sure. " + CALL + " done <tool almost"
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), 8))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = ToolCallStream()
    content, calls = "", []
    for piece in pieces:
        more, found = stream.feed(piece)
        assert "<tool_call>" not in more  # a call's text never leaks into the content stream
        content, calls = content + more, calls + found
    more, found = stream.finish()
    assert content + more == "Sure.  done <tool almost"
    calls += found
    assert [c.name for c in calls if c.id] == ["get_weather"]
    arguments = "".join(c.arguments for c in calls)  # what a client accumulates
    assert json.loads(arguments) == {"city": "Paris"}
    assert [c.done["function"]["arguments"] for c in calls if c.done] == [arguments]


def test_a_call_streams_its_arguments_in_pieces_as_they_come() -> None:
    """The name as soon as it is written, then every piece of the arguments except what may close the call."""
    stream = ToolCallStream()
    _, first = stream.feed('<tool_call>{"name": "get_weather", "arguments": ')
    assert [(c.index, c.name, c.arguments) for c in first] == [(0, "get_weather", "")]
    _, more = stream.feed('{"city": "Pa')
    assert [c.arguments for c in more] == ['{"city": "Pa']
    _, more = stream.feed('ris", "days": {"n": 2}}')  # the last brace may be the call's own: held back
    assert [c.arguments for c in more] == ['ris", "days": {"n": 2}']
    _, last = stream.feed("}</tool_call>")
    assert [c.arguments for c in last] == ["}", ""] and last[-1].done is not None
    assert json.loads(last[-1].done["function"]["arguments"]) == {"city": "Paris", "days": {"n": 2}}


def test_a_call_written_arguments_first_comes_whole() -> None:
    stream = ToolCallStream()
    _, pieces = stream.feed('<tool_call>{"arguments": {"city": "Rome"}, ')
    assert pieces == []
    _, pieces = stream.feed('"name": "get_weather"}</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in pieces] == [("get_weather", {"city": "Rome"})]


def test_fallback_prompt_lists_tools_and_writes_calls_and_results_as_text() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
    ]
    out = fallback_messages(messages, TOOLS)
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": CALL}
    assert out[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}


def body(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_forced_tool_choice_becomes_a_tool_call_grammar() -> None:
    assert grammar_spec(body(tools=TOOLS)) is None  # auto: the model chooses
    assert grammar_spec(body(tools=TOOLS, tool_choice="none")) is None
    spec, param = grammar_spec(body(tools=TOOLS, tool_choice="required")) or (None, None)
    assert param == "tools" and spec is not None and spec.kind == "tool_call"
    named = grammar_spec(body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert named is not None and named[0] == spec


@pytest.mark.parametrize(("fields", "message"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "not in tools"),
    ({"tool_choice": "required"}, "tool_choice requires tools"),
    ({"tools": TOOLS + TOOLS}, "names must be unique"),
    ({"response_format": {"type": "json_schema"}}, "needs a json_schema object"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "needs the tool_call_id"),
])
def test_bad_tool_fields_are_refused_naming_the_problem(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        body(**fields)


def test_a_template_that_knows_tools_gets_them_and_the_calls_as_objects() -> None:
    from transformers import AutoTokenizer

    from serving.api.admit import chat_messages, encode_chat, template_tools
    from serving.demo import tokenizer_path

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path()))
    tokenizer.chat_template = ("{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}"
                               "{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %} CALL "
                               "{{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}")
    request = body(tools=TOOLS, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}])
    text = tokenizer.decode(encode_chat(tokenizer, chat_messages(request), template_tools(request)))
    assert 'TOOLS [{"type": "function", "function": {"name": "get_weather"' in text
    assert 'assistant:  CALL {"city": "Paris"}' in text  # arguments reach the template as an object
    assert "tool: 18 C" in text and "<tool_response>" not in text  # no fallback for this template
