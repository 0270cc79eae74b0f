"""What the completions and chat routers share: model check, run set-up, collection, logprobs."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from serving.api.errors import ApiError
from serving.api.generation import (
    ClientGone,
    GenerationRun,
    admit,
    new_request_id,
    resolve_max_tokens,
    sampling_params,
    until_disconnect,
)
from serving.api.middleware import STATUS_CLIENT_CLOSED
from serving.api.schemas import SamplingFields
from serving.api.sse import DONE, EventStreamResponse, sse_event
from serving.api.state import Engine, ServerState
from serving.engine.types import GenerationRequest, RequestOutput, TokenLogprobs


def check_model(state: ServerState, model: str) -> None:
    if model != state.settings.model_name:
        raise ApiError(404, f"model {model!r} does not exist; this server serves {state.settings.model_name!r}",
                       param="model", code="model_not_found")


def start_run(request: Request, state: ServerState, engine: Engine, body: SamplingFields, prompt_ids: list[int],
              max_tokens: int | None, logprobs: int | None, id_prefix: str) -> GenerationRun:
    """Validate limits, admit (or refuse at once), and return the run, not yet started."""
    tokens = resolve_max_tokens(state, engine, max_tokens, len(prompt_ids))
    params = sampling_params(body, tokens, logprobs)
    generation = GenerationRequest(new_request_id(id_prefix), prompt_ids, params)
    admit(state, engine, generation)
    scope_state = request.scope.setdefault("state", {})
    fields: dict[str, Any] = scope_state.setdefault("log_fields", {})
    fields["engine_request_id"] = generation.request_id
    return GenerationRun(state, engine, generation, scope_state.get("received_at", time.monotonic()), fields)


@dataclass
class Collected:
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


async def collect(run: GenerationRun) -> Collected:
    result = Collected()
    parts: list[str] = []
    async for output in run.outputs():
        parts.append(output.new_text)
        result.logprobs.extend(output.logprobs or [])
        if output.finished:
            result.finish_reason = output.finish_reason
    result.text = "".join(parts)
    if result.finish_reason in (None, "abort"):
        raise aborted_error()
    return result


async def respond(request: Request, run: GenerationRun, stream: AsyncIterator[dict[str, Any]] | None,
                  whole: Callable[[Collected], dict[str, Any]]) -> Response:
    """SSE when ``stream`` is given (headers only once the first token is there); else wait for the
    whole output. Either way the generation is aborted if the client leaves."""
    try:
        if stream is not None:
            await until_disconnect(request.receive, run.prime())
            return EventStreamResponse(sse_events(run, stream), on_close=run.close)
        result = await until_disconnect(request.receive, collect(run))
    except ClientGone:
        return Response(status_code=STATUS_CLIENT_CLOSED)
    return JSONResponse(whole(result))


async def sse_events(run: GenerationRun, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Serialize chunks; a failure after the headers went out becomes an error event (no [DONE])."""
    try:
        async for chunk in chunks:
            yield sse_event(chunk)
    except ApiError as exc:
        yield sse_event(exc.body())
        return
    yield DONE


def aborted_error() -> ApiError:
    return ApiError(503, "generation was aborted (server shutting down)", code="aborted", retry_after=5)


def token_text(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id])) if tokenizer is not None else str(token_id)


def completion_logprobs(tokenizer: Any, entries: list[TokenLogprobs], offset: int) -> dict[str, Any]:
    """The legacy completions shape: parallel lists plus text offsets."""
    tokens = [token_text(tokenizer, e.token_id) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(tokenizer, t): lp for t, lp in e.top_logprobs} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Any, entries: list[TokenLogprobs]) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [
        {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top_logprobs]}
        for e in entries
    ]}


def check_finish(output: RequestOutput) -> None:
    if output.finished and output.finish_reason in (None, "abort"):
        raise aborted_error()
