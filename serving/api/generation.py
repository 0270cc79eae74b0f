"""The path every generation request takes: tokenize → admit → run with a deadline → account.

Admission is token-aware and answers at once: a request that can never fit is a 400 naming the
numbers, one that cannot be queued now is a 429 (queue full) or 503 (its expected queue wait
already exceeds the request timeout), both with Retry-After. A running request is aborted, and its
KV blocks freed, when its deadline passes or its client goes away.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.types import Receive

from serving.api.errors import ApiError
from serving.api.schemas import SamplingFields
from serving.api.state import Engine, ServerState
from serving.engine.types import EngineDeadError, GenerationRequest, RequestOutput, RequestRejected, SamplingParams

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def encode_text(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=True)
    return list(ids)


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


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    params = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        seed=body.seed,
        max_tokens=max_tokens,
        stop=body.stop_list,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
    )
    try:
        params.validate()
    except ValueError as exc:
        raise ApiError(400, str(exc), param=str(exc).split(" ", 1)[0], code="invalid_value") from exc
    return params


def resolve_max_tokens(state: ServerState, engine: Engine, requested: int | None, prompt_len: int) -> int:
    """Check the prompt against the limits and pick max_tokens (default: what fits, capped)."""
    limits = state.settings.config.scheduler
    context = min(engine.max_model_len, state.settings.config.max_model_len)
    if prompt_len == 0:
        raise ApiError(400, "prompt is empty", param="prompt", code="empty_prompt")
    if prompt_len > limits.max_input_len:
        raise ApiError(400, f"prompt has {prompt_len} tokens; the maximum input length is {limits.max_input_len}",
                       param="prompt", code="context_length_exceeded")
    if requested is not None and requested > limits.max_output_len:
        raise ApiError(400, f"max_tokens is {requested}; the maximum output length is {limits.max_output_len}",
                       param="max_tokens", code="invalid_value")
    max_tokens = requested if requested is not None else min(limits.max_output_len, context - prompt_len)
    if max_tokens < 1 or prompt_len + max_tokens > context:
        raise ApiError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} "
                       f"exceeds the context length {context}", param="max_tokens", code="context_length_exceeded")
    return max_tokens


def admit(state: ServerState, engine: Engine, request: GenerationRequest) -> None:
    timeout = state.settings.config.scheduler.request_timeout_s
    try:
        engine.check_admission(request)
    except RequestRejected as exc:
        if exc.kind in ("never_fits", "invalid"):
            raise ApiError(400, exc.reason, code="context_length_exceeded" if exc.kind == "never_fits"
                           else "invalid_value") from exc
        if exc.kind == "queue_full":
            raise ApiError(429, f"server busy: {exc.reason}", code="queue_full",
                           retry_after=_retry_after(state)) from exc
        raise ApiError(503, exc.reason, code="unavailable", retry_after=_retry_after(state)) from exc
    stats = engine.stats()
    wait = state.expected_queue_wait_s(stats)
    if wait > timeout:
        raise ApiError(503, f"overloaded: expected queue wait {wait:.1f}s exceeds the request timeout {timeout:g}s",
                       code="overloaded", retry_after=min(wait, 60.0))


def _retry_after(state: ServerState) -> float:
    return max(1.0, min(state.service_time_s or 1.0, 60.0))


class GenerationRun:
    """One admitted request: iterate ``outputs()``; records latency metrics and frees the engine
    request on every exit path (finish, timeout, disconnect, error)."""

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
        log_fields["prompt_tokens"] = self.prompt_tokens

    async def prime(self) -> None:
        """Wait for the first output, so a stream's status code can still say 429/503/504 (the
        headers go out only after this)."""
        stream = self._generate()
        self._primed = (stream, await anext(stream))

    async def close(self) -> None:
        """Release a primed stream that was never consumed (its client left before the first byte)."""
        if self._primed is not None:
            await _close(self._primed[0])

    async def outputs(self) -> AsyncIterator[RequestOutput]:
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
            await _close(stream)

    async def _generate(self) -> AsyncIterator[RequestOutput]:
        timeout = self.state.settings.config.scheduler.request_timeout_s
        deadline = self.received_at + timeout
        metrics = self.state.metrics
        self.state.begin_request()
        stream = self.engine.generate(self.request)
        finished = False
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
                except RequestRejected as exc:  # lost a race for the last queue slot
                    raise ApiError(429 if exc.retryable else 400, exc.reason, code=exc.kind,
                                   retry_after=_retry_after(self.state) if exc.retryable else None) from exc
                except EngineDeadError as exc:
                    raise ApiError(503, f"engine unavailable: {exc}", code="engine_unavailable",
                                   retry_after=5) from exc
                except TimeoutError:
                    raise ApiError(504, f"request timed out after {timeout:g}s; generation aborted",
                                   code="request_timeout") from None
                self._account(output)
                yield output
                if output.finished:
                    finished = True
                    break
        finally:
            if not finished:
                await self.engine.abort(self.request.request_id)
            await _close(stream)
            e2e = None
            if finished and self.finish_reason != "abort":
                e2e = (self.last_chunk_at or time.monotonic()) - self.received_at
                metrics.e2e.observe(e2e)
                if self.first_token_at is not None and self.completion_tokens > 1:
                    metrics.tpot.observe((e2e - (self.first_token_at - self.received_at))
                                         / (self.completion_tokens - 1))
            self.state.end_request(e2e)

    def _account(self, output: RequestOutput) -> None:
        now = time.monotonic()
        metrics = self.state.metrics
        if output.new_token_ids:
            if self.first_token_at is None:
                self.first_token_at = now
                ttft = now - self.received_at
                metrics.ttft.observe(ttft)
                self.log_fields["ttft_s"] = round(ttft, 6)
                metrics.queue_time.observe(_queue_time(output, now))
            elif self.last_chunk_at is not None:
                metrics.itl.observe(now - self.last_chunk_at)
            self.last_chunk_at = now
        self.prompt_tokens = output.num_prompt_tokens or self.prompt_tokens
        self.completion_tokens = output.num_generated_tokens
        self.log_fields["completion_tokens"] = self.completion_tokens
        if output.finished:
            self.finish_reason = output.finish_reason

    @property
    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def _queue_time(output: RequestOutput, now: float) -> float:
    # The engine reports when it scheduled a request first where it can; otherwise the time between
    # its arrival in the engine and its first token bounds the queue time from above.
    scheduled = getattr(output, "first_scheduled_time", None)
    if scheduled is not None and output.arrival_time:
        return max(0.0, float(scheduled) - output.arrival_time)
    if output.arrival_time and output.first_token_time:
        return max(0.0, output.first_token_time - output.arrival_time)
    return 0.0


async def _close(stream: AsyncIterator[RequestOutput]) -> None:
    aclose: Callable[[], Awaitable[None]] | None = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


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
        if not task.done():
            task.cancel()
