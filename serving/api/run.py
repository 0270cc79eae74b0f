"""Run: an admission's engine requests driven through the engine, the second of the request path's three steps
(admit → run → respond).

Each engine request is one ``Run``: the engine's admission answers on its first output (a refusal is a 400, or a
429 / 503 with Retry-After), its latency is recorded, and it is aborted, its KV blocks freed, when its deadline
passes or its client goes away (respond cancels it). ``Choices`` runs one HTTP request's runs side by side.

n > 1: the choices share the prompt's KV blocks through the engine's prefix cache (content-addressed full blocks).
A block gets its address only once its forward has run, so siblings admitted in the same step as the first choice
would all compute the prompt. Each prompt's first choice therefore starts alone; the others are queued once it has
produced its first output (its prompt is then in the cache), and compute only the prompt's last, partial block.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from serving.api.admit import Admission
from serving.api.errors import ApiError
from serving.api.state import Engine, ServerState
from serving.engine.types import (
    EngineDeadError,
    GenerationRequest,
    RequestOutput,
    RequestRejected,
    StepFailedError,
    TokenLogprobs,
)

_DONE = object()  # a choice's stream ended


def start(state: ServerState, engine: Engine, admission: Admission) -> Choices:
    """The admission's runs, not yet started: ``prime()`` or ``outputs()`` starts them."""
    runs = [Run(state, engine, request, admission.received_at, admission.log_fields)
            for request in admission.requests]
    return Choices(runs, admission.group_size)


@dataclass
class Collected:
    """A choice's whole output."""

    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with echo + logprobs (completions)


def rejection_error(state: ServerState, exc: RequestRejected) -> ApiError:
    """The engine refused the request: 400 if the request is wrong, 429 / 503 with Retry-After if it may retry."""
    if exc.kind == "never_fits":
        return ApiError(400, exc.reason, code="context_length_exceeded", param=exc.param)
    if exc.kind == "invalid":
        return ApiError(400, exc.reason, code="invalid_value", param=exc.param)
    if exc.kind == "queue_full":
        return ApiError(429, f"server busy: {exc.reason}", code="queue_full", retry_after=_retry_after(state))
    return ApiError(503, exc.reason, code="unavailable", retry_after=_retry_after(state))


def _retry_after(state: ServerState) -> float:
    """About one request's service time: a slot frees no sooner (at the start of an overload, before any
    request has finished, the oldest running request's age stands in for it)."""
    return max(1.0, min(state.typical_service_s() or 1.0, 60.0))


def aborted_error() -> ApiError:
    return ApiError(503, "generation was aborted (server shutting down)", code="aborted", retry_after=5)


def check_finish(output: RequestOutput) -> None:
    """A stream's last chunk: an aborted generation (server shutting down) is an error, not an answer."""
    if output.finished and output.finish_reason in (None, "abort"):
        raise aborted_error()


class Run:
    """One engine request on its way through the engine: iterate ``outputs()``; records latency metrics and frees
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


class Choices:
    """The runs of one request's choices; ``outputs()`` yields (choice index, output) as they come.

    Runs come in groups of ``group_size`` sharing one prompt (completions may send several prompts): each
    group's first run leads, its siblings start after the leader's first output."""

    def __init__(self, runs: list[Run], group_size: int) -> None:
        self.runs = runs
        self.group_size = group_size
        self.request_id = runs[0].request.request_id
        self._tasks: list[asyncio.Future[None]] = []  # one per started choice (n > 1)

    async def prime(self) -> None:
        """Wait for the first output of each prompt's first choice: the engine has admitted every prompt, so a
        stream's status code can still be an error."""
        leaders = self.runs[:: self.group_size]
        if len(leaders) == 1:
            await leaders[0].prime()
            return
        primes: list[asyncio.Future[None]] = [asyncio.ensure_future(run.prime()) for run in leaders]
        try:
            for prime in primes:
                await prime
        except BaseException:
            await _cancel(primes)
            await self.close()
            raise

    async def close(self) -> None:
        """The response is over or its client left: stop every choice (their engine requests are aborted)."""
        await _cancel(self._tasks)
        for run in self.runs:
            await run.close()

    async def collect(self) -> list[Collected]:
        """Every choice's whole output, in choice order."""
        results = [Collected() for _ in self.runs]
        parts: list[list[str]] = [[] for _ in self.runs]
        async for index, output in self.outputs():
            parts[index].append(output.new_text)
            results[index].logprobs.extend(output.logprobs or [])
            if output.prompt_logprobs is not None:
                results[index].prompt_logprobs = output.prompt_logprobs
            if output.finished:
                results[index].finish_reason = output.finish_reason
        for result, texts in zip(results, parts, strict=True):
            result.text = "".join(texts)
            if result.finish_reason in (None, "abort"):
                raise aborted_error()
        return results

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(self.runs) == 1:
            async with contextlib.aclosing(self.runs[0].outputs()) as stream:
                async for output in stream:
                    yield 0, output
            return
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async with contextlib.aclosing(self.runs[index].outputs()) as stream:
                    async for output in stream:
                        await queue.put((index, output))
                        if index % size == 0 and index not in led:  # its prompt is in the prefix cache now
                            led.add(index)
                            self._tasks.extend(asyncio.ensure_future(pump(i)) for i in range(index + 1, index + size))
            except BaseException as exc:  # re-raised by the consumer, which cancels the other choices
                await queue.put((index, exc))
                return
            await queue.put((index, _DONE))

        size, led = self.group_size, set[int]()  # led: groups whose siblings were started
        self._tasks = [asyncio.ensure_future(pump(i)) for i in range(0, len(self.runs), size)]
        remaining = len(self.runs)
        try:
            while remaining:
                index, item = await queue.get()
                if item is _DONE:
                    remaining -= 1
                    if index % size == 0 and index not in led:  # ended without any output: no siblings start
                        remaining -= size - 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            await _cancel(self._tasks)

    @property
    def usage(self) -> dict[str, int]:
        """Each prompt counted once, as OpenAI does; completion tokens of all choices."""
        prompt = sum(run.prompt_tokens for run in self.runs[:: self.group_size])
        completion = sum(run.completion_tokens for run in self.runs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _cancel(tasks: list[asyncio.Future[None]]) -> None:
    for task in tasks:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
