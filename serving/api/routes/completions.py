"""POST /v1/completions (the legacy text completion API)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from serving.api.deps import EngineDep, StateDep, check_model
from serving.api.generation import Collected, GenerationRun, check_finish, respond, start_run
from serving.api.routes.logprobs import completion_logprobs
from serving.api.schemas import CompletionRequest

router = APIRouter(tags=["completions"])


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request, engine: EngineDep,
                            state: StateDep) -> Response:
    check_model(state, body.model)
    prompt = body.single_prompt  # not empty: the schema refuses that
    if isinstance(prompt, list):
        prompt_ids = list(prompt)
    else:
        prompt_ids = await state.tokenizers.encode(prompt, add_special_tokens=True)  # off the event loop
    run = start_run(request, state, engine, body, prompt_ids, body.max_tokens, body.logprobs, "cmpl")
    created = int(time.time())
    base = {"id": run.request.request_id, "object": "text_completion", "created": created, "model": body.model}

    def whole(result: Collected) -> dict[str, Any]:
        logprobs = completion_logprobs(engine.tokenizer, result.logprobs, 0) if body.logprobs is not None else None
        choice = {"index": 0, "text": result.text, "logprobs": logprobs, "finish_reason": result.finish_reason}
        return {**base, "choices": [choice], "usage": run.usage}

    return await respond(request, run, _chunks(run, base, body, engine.tokenizer) if body.stream else None, whole)


async def _chunks(run: GenerationRun, base: dict[str, Any], body: CompletionRequest,
                  tokenizer: Any) -> AsyncIterator[dict[str, Any]]:
    offset = 0
    usage_field = {"usage": None} if body.include_usage else {}
    async for output in run.outputs():
        check_finish(output)
        if not output.new_text and not output.finished and not output.logprobs:
            continue
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(tokenizer, output.logprobs or [], offset)
        offset += len(output.new_text)
        choice = {"index": 0, "text": output.new_text, "logprobs": logprobs,
                  "finish_reason": output.finish_reason if output.finished else None}
        yield {**base, "choices": [choice], **usage_field}
    if body.include_usage:
        yield {**base, "choices": [], "usage": run.usage}
