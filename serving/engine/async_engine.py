"""The asyncio face of the engine: a step loop in its own thread, per-request output streams.

The event loop never runs a forward. Requests and aborts travel to the loop thread through a command
queue; outputs travel back into one `asyncio.Queue` per request, a step's outputs in one `call_soon_threadsafe`
(one wake-up of the event loop per step, not one per request: each wake-up is a write to the loop's self-pipe, a
return from its poll and a turn of the GIL between the two threads, and at 64 running requests a call per output
was 64 of them every step).

A step that raises fails the requests it ran (`StepFailedError` in their streams, their blocks freed)
and the loop goes on: one bad batch — an out-of-memory on a rare shape, a fault in one request's
processing — must not take the server down. A failure the engine cannot recover from (inconsistent
block accounting, a CUDA error that poisons the context, `_MAX_CONSECUTIVE_STEP_FAILURES` failed steps
in a row) is recorded (`healthy` turns False, `error` holds it), logged, and raised in every open
stream; the engine then refuses new work and /health turns 503 so the orchestrator replaces it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from serving.engine.config import EngineConfig
from serving.engine.engine import LLMEngine
from serving.engine.types import (
    EngineDeadError,
    EngineStats,
    GenerationRequest,
    RequestOutput,
    RequestRejected,
    StepFailedError,
)

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05
_MAX_CONSECUTIVE_STEP_FAILURES = 3
# Errors after which the device cannot be trusted: the CUDA context is lost, nothing more will succeed.
_FATAL_MARKERS = ("CUDA error", "device-side assert", "NCCL error", "illegal memory access")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: collections.deque[tuple[str, Any]] = collections.deque()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self._pending_adds = 0
        self._failed_steps_in_a_row = 0

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Load weights and build the engine (blocking: call it from a worker thread or the lifespan)."""
        return cls(LLMEngine.from_config(config))

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run_loop, name="engine-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the loop; requests still in flight end with finish_reason "abort"."""
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        await asyncio.to_thread(self.engine.close)  # tensor-parallel workers, if any
        for request_id in list(self._streams):
            self._deliver_error(request_id, EngineDeadError("engine stopped"))

    @property
    def healthy(self) -> bool:
        """False once the step loop has failed or stopped."""
        return self._error is None and not self._stopping and (self._thread is None or self._thread.is_alive())

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def device_type(self) -> str:
        """"cpu" or "cuda": where the model runs."""
        return self.engine.device.type

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # ---- requests -----------------------------------------------------------------------------------

    def check_admission(self, request: GenerationRequest) -> None:
        """Raise RequestRejected: kind "invalid"/"never_fits" (400) or "queue_full"/"unavailable" (429/503)."""
        if not self.healthy:
            raise RequestRejected("unavailable", f"engine is not running ({self._error or 'stopped'})")
        self.engine.check_admission(request, queued_elsewhere=self._pending_adds)
        if request.request_id in self._streams:
            raise RequestRejected("invalid", f"request_id {request.request_id!r} is already running")

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Admit the request (RequestRejected on the first iteration, before any output) and stream its
        outputs; closing the iterator early (client gone) aborts the request."""
        self.check_admission(request)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request.request_id] = stream
        self._pending_adds += 1
        self._submit("add", request)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    if isinstance(item, (EngineDeadError, RequestRejected, StepFailedError)):
                        raise item
                    raise EngineDeadError(f"engine loop failed: {item!r}") from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self._submit("abort", (request.request_id, None))

    async def abort(self, request_id: str) -> None:
        """Abort a request; returns once its blocks are back in the pool."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._submit("abort", (request_id, done))
        if self._thread is not None and self._thread.is_alive():
            await done

    def _submit(self, kind: str, payload: Any) -> None:
        self._commands.append((kind, payload))
        self._wakeup.set()

    # ---- the loop thread ----------------------------------------------------------------------------

    def _run_loop(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self.engine.check_alive()  # a tensor-parallel rank lost while idle: not ready at once
                    self._wakeup.wait(_IDLE_WAIT_S)
                    self._wakeup.clear()
                    continue
                self._deliver(self._step())
            self._abort_all()
        except BaseException as exc:  # recorded and surfaced, never swallowed
            log.exception("engine step loop failed")
            self._error = exc
            for request_id in list(self._streams):
                self._deliver_error(request_id, exc)
            self._fail_pending_commands()

    def _step(self) -> list[RequestOutput]:
        """One engine step; a recoverable failure fails the step's requests and returns no outputs."""
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._failed_steps_in_a_row += 1
            if (self._failed_steps_in_a_row >= _MAX_CONSECUTIVE_STEP_FAILURES or isinstance(exc, EngineDeadError)
                    or any(marker in str(exc) for marker in _FATAL_MARKERS)):
                raise
            log.exception("engine step failed (%d in a row); failing the requests it ran, the engine goes on",
                          self._failed_steps_in_a_row)
            failure = StepFailedError(f"engine step failed: {exc!r}")
            for request_id in self.engine.recover_from_failed_step():  # raises if the state is beyond repair
                self._deliver_error(request_id, failure)
            return []
        self._failed_steps_in_a_row = 0
        return outputs

    def _apply_commands(self) -> None:
        while self._commands:
            kind, payload = self._commands.popleft()
            if kind == "add":  # admitted by generate(): counted as pending until it is in the queue
                self._pending_adds -= 1
                try:
                    self.engine.enqueue(payload)
                except Exception as exc:  # this request's own fault: it fails alone, the loop goes on
                    log.warning("request %s refused while queueing: %r", payload.request_id, exc)
                    self.engine.abort_request(payload.request_id)
                    self._deliver_error(payload.request_id, RequestRejected("invalid", f"request refused: {exc}"))
            elif kind == "abort":
                request_id, done = payload
                output = self.engine.abort_request(request_id)
                if output is not None:
                    self._deliver([output])
                if done is not None:
                    done.get_loop().call_soon_threadsafe(_resolve, done)

    def _abort_all(self) -> None:
        self._apply_commands()
        outputs = [self.engine.abort_request(request_id) for request_id in list(self.engine.scheduler.requests)]
        self._deliver([output for output in outputs if output is not None])

    def _fail_pending_commands(self) -> None:
        while self._commands:
            kind, payload = self._commands.popleft()
            if kind == "abort" and payload[1] is not None:
                payload[1].get_loop().call_soon_threadsafe(_resolve, payload[1])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Outputs to their streams (a step's, or aborts'), in one call per event loop (the server has one; tests
        may have several)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)


def _put_all(items: list[tuple[asyncio.Queue[Any], RequestOutput]]) -> None:
    for queue, output in items:
        queue.put_nowait(output)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
