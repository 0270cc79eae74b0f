"""POST /v1/completions (the legacy text completion API)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from serving.api.choices import Choices, start_choices
from serving.api.deps import EngineDep, StateDep, check_model
from serving.api.generation import Collected, check_finish, respond
from serving.api.routes.logprobs import completion_logprobs, prompt_logprobs_first
from serving.api.schemas import CompletionRequest
from serving.api.state import Engine, ServerState
from serving.api.tools import attach_grammar, compile_grammar

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
    # echo with logprobs scores the prompt too; max_tokens=0 (echo only) needs the prompt's scoring to finish
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    if body.max_tokens == 0 and prompt_logprobs is None:
        prompt_logprobs = 0
    ranked = body.candidates > body.choices  # best_of: every candidate needs its logprobs to be ranked
    logprobs = body.logprobs if body.logprobs is not None or not ranked else 0
    grammar = await compile_grammar(engine, body)  # response_format: cached, compiled off the event loop
    choices = start_choices(request, state, engine, body, prompt_ids, body.max_tokens, logprobs, "cmpl",
                            body.candidates, prompt_logprobs)
    attach_grammar(choices.runs, grammar)
    echo = await echo_text(state, engine, prompt, prompt_ids) if body.echo else ""
    created = int(time.time())
    base = {"id": choices.request_id, "object": "text_completion", "created": created, "model": body.model}

    def whole(results: list[Collected]) -> dict[str, Any]:
        if ranked:
            results = sorted(results, key=mean_logprob, reverse=True)[: body.choices]
        return {**base, "choices": [choice(engine.tokenizer, body, i, r, prompt_ids, echo)
                                    for i, r in enumerate(results)], "usage": choices.usage}

    stream = _chunks(choices, base, body, engine.tokenizer, prompt_ids, echo) if body.stream else None
    return await respond(request, choices, stream, whole)


async def echo_text(state: ServerState, engine: Engine, prompt: str | list[int], prompt_ids: list[int]) -> str:
    """The prompt as the response repeats it: its own text, or the decoded ids of a token prompt."""
    if isinstance(prompt, str):
        return prompt
    tokenizer = engine.tokenizer
    if tokenizer is None:
        return ""
    return str(await state.tokenizers.run(lambda: tokenizer.decode(prompt_ids)))


def mean_logprob(result: Collected) -> float:
    """best_of ranks candidates by log-probability per token, as OpenAI does."""
    return sum(e.logprob for e in result.logprobs) / max(len(result.logprobs), 1)


def choice(tokenizer: Any, body: CompletionRequest, index: int, result: Collected, prompt_ids: list[int],
           echo: str) -> dict[str, Any]:
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(tokenizer, result.logprobs, len(echo))
        if body.echo:
            logprobs = prompt_logprobs_first(tokenizer, prompt_ids, result.prompt_logprobs or [], logprobs)
    return {"index": index, "text": echo + result.text, "logprobs": logprobs, "finish_reason": result.finish_reason}


async def _chunks(choices: Choices, base: dict[str, Any], body: CompletionRequest, tokenizer: Any,
                  prompt_ids: list[int], echo: str) -> AsyncIterator[dict[str, Any]]:
    offsets = [len(echo)] * body.choices
    echoed = [False] * body.choices
    usage_field = {"usage": None} if body.include_usage else {}
    async for index, output in choices.outputs():
        check_finish(output)
        if not output.new_text and not output.finished and not output.logprobs and echoed[index]:
            continue
        text = output.new_text if echoed[index] else echo + output.new_text
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(tokenizer, output.logprobs or [], offsets[index])
            if body.echo and not echoed[index]:
                logprobs = prompt_logprobs_first(tokenizer, prompt_ids, output.prompt_logprobs or [], logprobs)
        echoed[index] = True
        offsets[index] += len(output.new_text)
        item = {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": output.finish_reason if output.finished else None}
        yield {**base, "choices": [item], **usage_field}
    if body.include_usage:
        yield {**base, "choices": [], "usage": choices.usage}
