"""Respond: the runs' outputs as the endpoint's answer, the last of the request path's three steps
(admit → run → respond).

A whole answer waits for every choice; a stream (server-sent events) sends its headers only once the first token
is there, so an engine refusal is still a status code. Either way the generation stops the moment the client goes
away: Starlette's StreamingResponse notices a disconnect only when its next write fails, so this module listens for
``http.disconnect`` while the engine works and cancels the work at once, and the run's cleanup (engine abort, KV
blocks freed) runs immediately. What each endpoint's answer looks like is its renderer's (serving/api/render/).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from serving.api.errors import ApiError
from serving.api.middleware import STATUS_CLIENT_CLOSED
from serving.api.render import chat as chat_render
from serving.api.render import completions as completion_render
from serving.api.render import responses as response_render
from serving.api.run import Choices
from serving.api.schemas import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from serving.api.state import ServerState

DONE = b"data: [DONE]\n\n"
T = TypeVar("T")
Result = TypeVar("Result", covariant=True)


async def chat(request: Request, body: ChatCompletionRequest, choices: Choices, tokenizer: Any) -> Response:
    base = {"id": choices.request_id, "object": "chat.completion", "created": int(time.time()), "model": body.model}
    stream = chat_render.chunks(choices, base, body, tokenizer) if body.stream else None
    return await respond(request, choices, stream, lambda results: chat_render.whole(choices, base, body, tokenizer,
                                                                                     results))


async def completion(request: Request, body: CompletionRequest, choices: Choices, prompt_ids: list[list[int]],
                     state: ServerState, tokenizer: Any) -> Response:
    echoes = [await completion_render.echo_text(state, tokenizer, p, ids) if body.echo else ""
              for p, ids in zip(body.prompts, prompt_ids, strict=True)]
    base = {"id": choices.request_id, "object": "text_completion", "created": int(time.time()), "model": body.model}
    stream = completion_render.chunks(choices, base, body, tokenizer, prompt_ids, echoes) if body.stream else None
    return await respond(request, choices, stream, lambda results: completion_render.whole(
        choices, base, body, tokenizer, prompt_ids, echoes, results))


async def response(request: Request, body: ResponsesRequest, chat_body: ChatCompletionRequest, choices: Choices,
                   tokenizer: Any) -> Response:
    created = time.time()
    stream = response_render.events(choices, body, chat_body, tokenizer, created) if body.stream else None
    return await respond(request, choices, stream, lambda results: response_render.whole(
        choices, body, chat_body, tokenizer, created, results), typed_events=True)


class Respondable(Protocol[Result]):
    """A run (or the runs of n choices): primed before a stream's headers, collected for a whole answer."""

    async def prime(self) -> None: ...

    async def close(self) -> None: ...

    async def collect(self) -> Result: ...


async def respond(request: Request, run: Respondable[Result], stream: AsyncIterator[dict[str, Any]] | None,
                  whole: Callable[[Result], dict[str, Any]], typed_events: bool = False) -> Response:
    """SSE when ``stream`` is given (headers only once the first token is there); else wait for the
    whole output. Either way the generation is aborted if the client leaves. typed_events: the Responses API's
    stream (see sse_events)."""
    try:
        if stream is not None:
            await until_disconnect(request.receive, run.prime())
            return EventStreamResponse(sse_events(stream, typed_events), on_close=run.close)
        result = await until_disconnect(request.receive, run.collect())
    except ClientGone:
        return Response(status_code=STATUS_CLIENT_CLOSED)
    return JSONResponse(whole(result))


# ---- server-sent events ----------------------------------------------------------------------------------------


async def sse_events(chunks: AsyncIterator[dict[str, Any]], typed: bool = False) -> AsyncIterator[bytes]:
    """Serialize chunks; a failure after the headers went out becomes an error event (no [DONE]). typed: each
    event named by its chunk's `type` and no [DONE] (the Responses API); its error event is also of type
    "error", with the code and message at the top, as OpenAI sends it."""
    try:
        async for chunk in chunks:
            yield sse_event(chunk, chunk["type"] if typed else None)
    except ApiError as exc:
        body = exc.body()
        yield sse_event({"type": "error", **body["error"], **body}, "error") if typed else sse_event(body)
        return
    if not typed:
        yield DONE


def sse_event(payload: dict[str, Any], event: str | None = None) -> bytes:
    """One event; `event` names it (the Responses API's typed events), else it is a plain data line."""
    data = b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
    return b"event: " + event.encode() + b"\n" + data if event else data


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnect(receive, stream())
        except (ClientGone, OSError):
            scope.setdefault("state", {})["disconnected"] = True
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.on_close is not None:
                await self.on_close()


# ---- the client going away -------------------------------------------------------------------------------------


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Run ``work``; if the client disconnects first, cancel it (its cleanup runs) and raise ClientGone."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):  # the client is gone; cleanup ran
            pass
        raise ClientGone
    finally:
        watcher.cancel()
        if not task.done():  # we were cancelled: let the work's own cleanup finish before ours runs
            task.cancel()
            try:
                await asyncio.shield(task)
            except BaseException:  # noqa: BLE001 - cancelled work ends in CancelledError or its own error
                pass
