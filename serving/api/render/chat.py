"""POST /v1/chat/completions' answer: a chat.completion, or its chat.completion.chunk stream (tool calls parsed
out of the text when tools are on)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from serving.api.render.logprobs import chat_logprobs
from serving.api.render.tool_calls import ToolCallStream, parse_tool_calls, tool_call_deltas
from serving.api.run import Choices, Collected, check_finish
from serving.api.schemas import ChatCompletionRequest


def whole(choices: Choices, base: dict[str, Any], body: ChatCompletionRequest, tokenizer: Any,
          results: list[Collected]) -> dict[str, Any]:
    def choice(index: int, result: Collected) -> dict[str, Any]:
        message, finish_reason = assistant_message(body, result.text, result.finish_reason)
        return {"index": index, "message": message, "finish_reason": finish_reason,
                "logprobs": chat_logprobs(tokenizer, result.logprobs) if body.logprobs else None}

    return {**base, "choices": [choice(i, r) for i, r in enumerate(results)], "usage": choices.usage}


def assistant_message(body: ChatCompletionRequest, text: str, finish_reason: str | None
                      ) -> tuple[dict[str, Any], str | None]:
    """The whole response's message and finish reason: tool calls parsed out when tools are on."""
    if not body.tools_active:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = parse_tool_calls(text)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, (
        "tool_calls" if finish_reason == "stop" else finish_reason)


async def chunks(choices: Choices, base: dict[str, Any], body: ChatCompletionRequest,
                 tokenizer: Any) -> AsyncIterator[dict[str, Any]]:
    base = {**base, "object": "chat.completion.chunk"}
    usage_field = {"usage": None} if body.include_usage else {}
    for index in range(body.choices):
        yield {**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}], **usage_field}
    parsers = {index: ToolCallStream() for index in range(body.choices)} if body.tools_active else {}
    async for index, output in choices.outputs():
        check_finish(output)
        if not output.new_text and not output.finished and not output.logprobs:
            continue
        text, calls = output.new_text, list[dict[str, Any]]()
        finish_reason: str | None = output.finish_reason if output.finished else None
        parser = parsers.get(index)
        if parser is not None:  # tool calls leave the content stream for delta.tool_calls, arguments in pieces
            text, pieces = parser.feed(text)
            if output.finished:
                more, last = parser.finish()
                text, pieces = text + more, pieces + last
            calls = tool_call_deltas(pieces)
            if finish_reason == "stop" and parser.calls_made:
                finish_reason = "tool_calls"
        delta: dict[str, Any] = {"content": text} if text else {}
        if calls:
            delta["tool_calls"] = calls
        logprobs = chat_logprobs(tokenizer, output.logprobs or []) if body.logprobs else None
        if not delta and not output.finished and not logprobs:
            continue
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        yield {**base, "choices": [choice], **usage_field}
    if body.include_usage:
        yield {**base, "choices": [], "usage": choices.usage}
