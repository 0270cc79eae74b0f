"""POST /v1/chat/completions: messages rendered with the tokenizer's chat template."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from serving.api.deps import EngineDep, StateDep, check_model
from serving.api.errors import ApiError
from serving.api.generation import Collected, GenerationRun, check_finish, respond, start_run
from serving.api.routes.logprobs import chat_logprobs
from serving.api.schemas import ChatCompletionRequest

router = APIRouter(tags=["chat"])


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, engine: EngineDep,
                                 state: StateDep) -> Response:
    check_model(state, body.model)
    messages = [{"role": m.role, "content": m.text} for m in body.messages]
    pool = state.tokenizers
    pool.check_length(sum(len(m["content"]) for m in messages), "messages")
    prompt_ids = await pool.run(lambda: encode_chat(engine.tokenizer, messages))  # off the event loop
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    run = start_run(request, state, engine, body, prompt_ids, body.output_limit, logprobs, "chatcmpl")
    base = {"id": run.request.request_id, "object": "chat.completion", "created": int(time.time()),
            "model": body.model}

    def whole(result: Collected) -> dict[str, Any]:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": result.text},
            "logprobs": chat_logprobs(engine.tokenizer, result.logprobs) if body.logprobs else None,
            "finish_reason": result.finish_reason,
        }
        return {**base, "choices": [choice], "usage": run.usage}

    return await respond(request, run, _chunks(run, base, body, engine.tokenizer) if body.stream else None, whole)


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Render the tokenizer's chat template with the assistant prompt appended, then tokenize."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError(400, "this model has no chat template; use /v1/completions", code="no_chat_template")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # template errors are the request's fault (e.g. role order)
        raise ApiError(400, f"messages: cannot apply the chat template: {exc}", param="messages") from exc
    # The template already carries BOS and special tokens.
    return list(tokenizer.encode(text, add_special_tokens=False))


async def _chunks(run: GenerationRun, base: dict[str, Any], body: ChatCompletionRequest,
                  tokenizer: Any) -> AsyncIterator[dict[str, Any]]:
    base = {**base, "object": "chat.completion.chunk"}
    usage_field = {"usage": None} if body.include_usage else {}
    yield {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}], **usage_field}
    async for output in run.outputs():
        check_finish(output)
        if not output.new_text and not output.finished and not output.logprobs:
            continue
        delta = {"content": output.new_text} if output.new_text else {}
        logprobs = chat_logprobs(tokenizer, output.logprobs or []) if body.logprobs else None
        choice = {"index": 0, "delta": delta, "logprobs": logprobs,
                  "finish_reason": output.finish_reason if output.finished else None}
        yield {**base, "choices": [choice], **usage_field}
    if body.include_usage:
        yield {**base, "choices": [], "usage": run.usage}
