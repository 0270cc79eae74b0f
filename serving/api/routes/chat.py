"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from serving.api.choices import Choices, start_choices
from serving.api.deps import EngineDep, StateDep, check_model
from serving.api.errors import ApiError
from serving.api.generation import Collected, check_finish, respond
from serving.api.routes.logprobs import chat_logprobs
from serving.api.schemas import ChatCompletionRequest
from serving.api.state import Engine, ServerState
from serving.api.tools import (
    ToolCallStream,
    assistant_message,
    attach_grammar,
    chat_messages,
    compile_grammar,
    fallback_messages,
    template_knows_tools,
    template_tools,
    tool_call_deltas,
    tools_active,
)

router = APIRouter(tags=["chat"])


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, engine: EngineDep,
                                 state: StateDep) -> Response:
    choices = await start_chat(body, request, engine, state, "chatcmpl")
    base = {"id": choices.request_id, "object": "chat.completion", "created": int(time.time()),
            "model": body.model}

    def whole(results: list[Collected]) -> dict[str, Any]:
        def choice(index: int, result: Collected) -> dict[str, Any]:
            message, finish_reason = assistant_message(body, result.text, result.finish_reason)
            return {"index": index, "message": message, "finish_reason": finish_reason,
                    "logprobs": chat_logprobs(engine.tokenizer, result.logprobs) if body.logprobs else None}

        return {**base, "choices": [choice(i, r) for i, r in enumerate(results)], "usage": choices.usage}

    stream = _chunks(choices, base, body, engine.tokenizer) if body.stream else None
    return await respond(request, choices, stream, whole)


async def start_chat(body: ChatCompletionRequest, request: Request, engine: Engine, state: ServerState,
                     id_prefix: str) -> Choices:
    """A chat request admitted and started: its prompt rendered and tokenized, its grammar compiled (both off the
    event loop), its choices through the one request path (serving/api/generation.py). The Responses API
    translates its requests to this one (serving/api/responses.py)."""
    check_model(state, body.model)
    messages = chat_messages(body)
    tools = template_tools(body)
    pool = state.tokenizers
    pool.check_length(sum(len(m["content"]) for m in messages) + len(json.dumps(tools or [])), "messages")
    prompt_ids = await pool.run(lambda: encode_chat(engine.tokenizer, messages, tools))  # off the event loop
    grammar = await compile_grammar(engine, body)  # response_format or a forced tool_choice: cached, off the loop
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    choices = start_choices(request, state, engine, body, prompt_ids, body.output_limit, logprobs, id_prefix,
                            body.choices)
    attach_grammar(choices.runs, grammar)
    return choices


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                ) -> list[int]:
    """Render the tokenizer's chat template with the assistant prompt appended, then tokenize. Tools go
    through the template when it knows them, else through the fallback of serving/api/tools.py."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError(400, "this model has no chat template; use /v1/completions", code="no_chat_template")
    try:
        if template_knows_tools(tokenizer):
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        else:
            text = tokenizer.apply_chat_template(fallback_messages(messages, tools), tokenize=False,
                                                 add_generation_prompt=True)
    except Exception as exc:  # template errors are the request's fault (e.g. role order)
        raise ApiError(400, f"messages: cannot apply the chat template: {exc}", param="messages") from exc
    # The template already carries BOS and special tokens.
    return list(tokenizer.encode(text, add_special_tokens=False))


async def _chunks(choices: Choices, base: dict[str, Any], body: ChatCompletionRequest,
                  tokenizer: Any) -> AsyncIterator[dict[str, Any]]:
    base = {**base, "object": "chat.completion.chunk"}
    usage_field = {"usage": None} if body.include_usage else {}
    for index in range(body.choices):
        yield {**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}], **usage_field}
    parsers = {index: ToolCallStream() for index in range(body.choices)} if tools_active(body) else {}
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
