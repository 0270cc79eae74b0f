"""The one path every generation request takes, top to bottom: admit → run → respond.

Each check happens once, at its layer:
- the body's shape and ranges (sampling fields, an empty prompt): the pydantic schemas, before a router runs;
- the served model name: ``check_model`` (serving/api/deps.py), before the prompt is built;
- the server's limits (input / output length, context) and its expected queue wait: ``start_run``, here;
- the engine's own limits (token ids, KV cache, queue): the engine's one admission check, which runs when
  the run starts, before any output, so a stream can still answer with its status code.

A request that can never fit is a 400 naming the numbers; one that cannot be queued now is a 429 (queue
full) or 503 (its expected queue wait already exceeds the request timeout), both with Retry-After. A
running request is aborted, and its KV blocks freed, when its deadline passes or its client goes away.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from serving.api.disconnect import ClientGone, until_disconnect
from serving.api.errors import ApiError
from serving.api.middleware import STATUS_CLIENT_CLOSED
from serving.api.schemas import SamplingFields
from serving.api.sse import DONE, EventStreamResponse, sse_event
from serving.api.state import Engine, ServerState
from serving.engine.types import (
    EngineDeadError,
    GenerationRequest,
    RequestOutput,
    RequestRejected,
    SamplingParams,
    StepFailedError,
    TokenLogprobs,
)

# ---- admit ----------------------------------------------------------------------------------------------


def start_run(request: Request, state: ServerState, engine: Engine, body: SamplingFields, prompt_ids: list[int],
              max_tokens: int | None, logprobs: int | None, id_prefix: str,
              prompt_logprobs: int | None = None) -> GenerationRun:
    """Check the server's limits, admit (or refuse at once), and return the run, not yet started."""
    tokens = resolve_max_tokens(state, engine, max_tokens, len(prompt_ids))
    params = sampling_params(body, tokens, logprobs)
    params.prompt_logprobs = prompt_logprobs
    generation = GenerationRequest(new_request_id(id_prefix), prompt_ids, params)
    admit(state, engine, generation)
    scope_state = request.scope.setdefault("state", {})
    fields: dict[str, Any] = scope_state.setdefault("log_fields", {})
    fields["engine_request_id"] = generation.request_id
    return GenerationRun(state, engine, generation, scope_state.get("received_at", time.monotonic()), fields)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def resolve_max_tokens(state: ServerState, engine: Engine, requested: int | None, prompt_len: int) -> int:
    """Check the prompt against the server's limits and pick max_tokens (default: what fits, capped)."""
    limits = state.settings.config.scheduler
    context = min(engine.max_model_len, state.settings.config.max_model_len)
    if prompt_len > limits.max_input_len:
        raise ApiError(400, f"prompt has {prompt_len} tokens; the maximum input length is {limits.max_input_len}",
                       param="prompt", code="context_length_exceeded")
    if requested is not None and requested > limits.max_output_len:
        raise ApiError(400, f"max_tokens is {requested}; the maximum output length is {limits.max_output_len}",
                       param="max_tokens", code="invalid_value")
    max_tokens = requested if requested is not None else min(limits.max_output_len, context - prompt_len)
    if (max_tokens < 1 and requested != 0) or prompt_len + max_tokens > context:  # 0: scoring the prompt only
        raise ApiError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} "
                       f"exceeds the context length {context}", param="max_tokens", code="context_length_exceeded")
    return max_tokens


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The body's sampling fields (already range-checked by the schema) as the engine's parameters."""
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        seed=body.seed,
        max_tokens=max_tokens,
        stop=body.stop_list,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias={int(token): bias for token, bias in (body.logit_bias or {}).items()},
    )


def admit(state: ServerState, engine: Engine, request: GenerationRequest) -> None:
    """The server's admission: refuse at once what would wait past its timeout in the queue. (The engine's
    own limits are the engine's to check, once, when the run starts.)"""
    timeout = state.settings.config.scheduler.request_timeout_s
    wait = state.expected_queue_wait_s(engine.stats())
    if wait > timeout:
        raise ApiError(503, f"overloaded: expected queue wait {wait:.1f}s exceeds the request timeout {timeout:g}s",
                       code="overloaded", retry_after=min(wait, 60.0))


def rejection_error(state: ServerState, exc: RequestRejected) -> ApiError:
    """The engine refused the request: 400 if the request is wrong, 429 / 503 with Retry-After if it may retry."""
    if exc.kind == "never_fits":
        return ApiError(400, exc.reason, code="context_length_exceeded")
    if exc.kind == "invalid":
        return ApiError(400, exc.reason, code="invalid_value")
    if exc.kind == "queue_full":
        return ApiError(429, f"server busy: {exc.reason}", code="queue_full", retry_after=_retry_after(state))
    return ApiError(503, exc.reason, code="unavailable", retry_after=_retry_after(state))


def _retry_after(state: ServerState) -> float:
    """About one request's service time: a slot frees no sooner (at the start of an overload, before any
    request has finished, the oldest running request's age stands in for it)."""
    return max(1.0, min(state.typical_service_s() or 1.0, 60.0))


# ---- run ------------------------------------------------------------------------------------------------


class GenerationRun:
    """One request on its way through the engine: iterate ``outputs()``; records latency metrics and frees
    the engine request on every exit path (finish, timeout, disconnect, error)."""

    def __init__(self, state: ServerState, engine: Engine, request: GenerationRequest, received_at: float,
                 log_fields: dict[str, Any]) -> None:
        self.state = state
        self.engine = engine
        self.request = request
        self.received_at = received_at
        self.log_fields = log_fields
        self.first_token_at: float | None = None
        self.last_chunk_at: float | None = None
        self.prompt_tokens = len(request.prompt_token_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._primed: tuple[AsyncIterator[RequestOutput], RequestOutput] | None = None
        self._closing: asyncio.Future[None] | None = None
        log_fields["prompt_tokens"] = self.prompt_tokens

    async def prime(self) -> None:
        """Wait for the first output, so a stream's status code can still say 400/429/503/504 (the
        headers go out only after this)."""
        stream = self._generate()
        self._primed = (stream, await anext(stream))

    async def close(self) -> None:
        """Release a primed stream (its client left before the first byte, or the response is over). Safe
        to call from several places at once (the response's end and the outputs' finalizer): one close runs,
        the others wait for it — a second aclose() of a generator still closing raises RuntimeError."""
        if self._primed is None:
            return
        if self._closing is None:
            self._closing = asyncio.ensure_future(_close(self._primed[0]))
        await asyncio.shield(self._closing)

    async def outputs(self) -> AsyncGenerator[RequestOutput]:
        if self._primed is None:
            async for output in self._generate():
                yield output
            return
        stream, first = self._primed
        try:
            yield first
            if not first.finished:
                async for output in stream:
                    yield output
        finally:
            await self.close()

    async def _generate(self) -> AsyncIterator[RequestOutput]:
        timeout = self.state.settings.config.scheduler.request_timeout_s
        deadline = self.received_at + timeout
        self.state.begin_request(self.request.request_id)
        stream = self.engine.generate(self.request)
        in_engine, finished = True, False
        try:
            while True:
                remaining = deadline - time.monotonic()
                try:
                    if remaining <= 0:
                        raise TimeoutError
                    async with asyncio.timeout(remaining):
                        output = await anext(stream)
                except StopAsyncIteration:
                    break
                except RequestRejected as exc:  # the engine's admission, on the first output
                    in_engine = False
                    raise rejection_error(self.state, exc) from exc
                except EngineDeadError as exc:
                    raise ApiError(503, f"engine unavailable: {exc}", code="engine_unavailable",
                                   retry_after=5) from exc
                except StepFailedError as exc:  # this request's batch failed; the engine goes on
                    in_engine = False
                    raise ApiError(503, f"generation failed: {exc}; retry the request", code="engine_step_failed",
                                   retry_after=1) from exc
                except TimeoutError:
                    raise ApiError(504, f"request timed out after {timeout:g}s; generation aborted",
                                   code="request_timeout") from None
                self._account(output)
                yield output
                if output.finished:
                    finished = True
                    break
        finally:
            if in_engine and not finished:
                await self.engine.abort(self.request.request_id)
            await _close(stream)
            self.state.end_request(self._record_latency() if finished else None, self.request.request_id)

    def _account(self, output: RequestOutput) -> None:
        now = time.monotonic()
        metrics = self.state.metrics
        if output.new_token_ids:
            if self.first_token_at is None:
                self.first_token_at = now
                ttft = now - self.received_at
                metrics.ttft.observe(ttft)
                self.log_fields["ttft_s"] = round(ttft, 6)
                metrics.queue_time.observe(_queue_time(output))
            elif self.last_chunk_at is not None:
                metrics.itl.observe(now - self.last_chunk_at)
            self.last_chunk_at = now
        self.prompt_tokens = output.num_prompt_tokens or self.prompt_tokens
        self.completion_tokens = output.num_generated_tokens
        self.log_fields["completion_tokens"] = self.completion_tokens
        if output.finished:
            self.finish_reason = output.finish_reason

    def _record_latency(self) -> float | None:
        """End-to-end latency and time per output token of a finished request (None if it was aborted)."""
        if self.finish_reason == "abort":
            return None
        e2e = (self.last_chunk_at or time.monotonic()) - self.received_at
        self.state.metrics.e2e.observe(e2e)
        if self.first_token_at is not None and self.completion_tokens > 1:
            self.state.metrics.tpot.observe((e2e - (self.first_token_at - self.received_at))
                                            / (self.completion_tokens - 1))
        return e2e

    @property
    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def _queue_time(output: RequestOutput) -> float:
    # The engine does not report when it first scheduled the request; the time between its arrival in the
    # engine and its first token bounds the queue time from above.
    if output.arrival_time and output.first_token_time:
        return max(0.0, output.first_token_time - output.arrival_time)
    return 0.0


async def _close(stream: AsyncIterator[RequestOutput]) -> None:
    aclose: Callable[[], Awaitable[None]] | None = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


# ---- respond --------------------------------------------------------------------------------------------


@dataclass
class Collected:
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with echo + logprobs (completions)


Result = TypeVar("Result", covariant=True)


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


def check_finish(output: RequestOutput) -> None:
    """A stream's last chunk: an aborted generation (server shutting down) is an error, not an answer."""
    if output.finished and output.finish_reason in (None, "abort"):
        raise aborted_error()


def aborted_error() -> ApiError:
    return ApiError(503, "generation was aborted (server shutting down)", code="aborted", retry_after=5)
