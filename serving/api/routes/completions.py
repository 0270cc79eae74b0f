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
    prompts = body.prompts  # none empty: the schema refuses that
    prompt_ids = [list(p) if isinstance(p, list) else await state.tokenizers.encode(p, add_special_tokens=True)
                  for p in prompts]  # text is encoded off the event loop
    # echo with logprobs scores the prompt too; max_tokens=0 (echo only) needs the prompt's scoring to finish
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    if body.max_tokens == 0 and prompt_logprobs is None:
        prompt_logprobs = 0
    ranked = body.candidates > body.choices  # best_of: every candidate needs its logprobs to be ranked
    logprobs = body.logprobs if body.logprobs is not None or not ranked else 0
    grammar = await compile_grammar(engine, body)  # response_format: cached, compiled off the event loop
    # choices prompt by prompt: OpenAI's index of choice j of prompt i is i * n + j
    choices = Choices.concat([start_choices(request, state, engine, body, ids, body.max_tokens, logprobs, "cmpl",
                                            body.candidates, prompt_logprobs) for ids in prompt_ids])
    attach_grammar(choices.runs, grammar)
    echoes = [await echo_text(state, engine, p, ids) if body.echo else "" for p, ids in zip(prompts, prompt_ids,
                                                                                           strict=True)]
    created = int(time.time())
    base = {"id": choices.request_id, "object": "text_completion", "created": created, "model": body.model}

    def whole(results: list[Collected]) -> dict[str, Any]:
        out = []
        for i, ids in enumerate(prompt_ids):
            group = results[i * body.candidates : (i + 1) * body.candidates]
            if ranked:
                group = sorted(group, key=mean_logprob, reverse=True)[: body.choices]
            out += [choice(engine.tokenizer, body, i * body.choices + j, r, ids, echoes[i])
                    for j, r in enumerate(group)]
        return {**base, "choices": out, "usage": choices.usage}

    stream = _chunks(choices, base, body, engine.tokenizer, prompt_ids, echoes) if body.stream else None
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
                  prompt_ids: list[list[int]], echoes: list[str]) -> AsyncIterator[dict[str, Any]]:
    """Streamed: best_of is n (the schema says so), so run i is choice i, of prompt i // n."""
    n = body.choices
    offsets = [len(echoes[i // n]) for i in range(len(choices.runs))]
    echoed = [False] * len(choices.runs)
    usage_field = {"usage": None} if body.include_usage else {}
    async for index, output in choices.outputs():
        check_finish(output)
        if not output.new_text and not output.finished and not output.logprobs and echoed[index]:
            continue
        echo = "" if echoed[index] else echoes[index // n]
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(tokenizer, output.logprobs or [], offsets[index])
            if body.echo and not echoed[index]:
                logprobs = prompt_logprobs_first(tokenizer, prompt_ids[index // n], output.prompt_logprobs or [],
                                                 logprobs)
        echoed[index] = True
        offsets[index] += len(output.new_text)
        item = {"index": index, "text": echo + output.new_text, "logprobs": logprobs,
                "finish_reason": output.finish_reason if output.finished else None}
        yield {**base, "choices": [item], **usage_field}
    if body.include_usage:
        yield {**base, "choices": [], "usage": choices.usage}
