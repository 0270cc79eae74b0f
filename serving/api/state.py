"""What the server knows about itself: the engine, how far start-up got, drain, in-flight work."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from serving.api.metrics import ServerMetrics
from serving.api.settings import Settings
from serving.engine.types import EngineStats, GenerationRequest, RequestOutput

# Weight of the newest request in the moving average of service time (admission's wait estimate).
_SERVICE_TIME_EWMA = 0.2


class Engine(Protocol):
    """What the API needs of ``serving.engine.AsyncEngine``."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def error(self) -> BaseException | None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...


@dataclass
class ServerState:
    settings: Settings
    metrics: ServerMetrics
    engine: Engine | None = None
    tokenizers: Any = None  # serving.api.tokenize.TokenizerPool once the engine is up
    phase: str = "starting"  # starting → verifying weights → loading model → warming up → ready
    failure: str | None = None  # why start-up failed; the server then never becomes ready
    draining: bool = False
    inflight: int = 0  # generation requests admitted and not yet finished
    # their engine request ids -> when they began (drain aborts them at the deadline; Retry-After before
    # any request has finished)
    active: dict[str, float] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)
    service_time_s: float | None = None  # moving average of end-to-end latency of finished requests

    def readiness(self) -> tuple[bool, str]:
        if self.failure is not None:
            return False, self.failure
        if self.draining:
            return False, "draining: shutting down"
        if self.phase != "ready" or self.engine is None:
            return False, f"not ready: {self.phase}"
        if not self.engine.healthy:
            return False, f"engine stopped: {self.engine.error!r}"
        return True, "ready"

    def liveness(self) -> tuple[bool, str]:
        if self.engine is not None and not self.engine.healthy and self.phase == "ready":
            return False, f"engine loop died: {self.engine.error!r}"
        return True, self.phase if self.failure is None else f"alive, not ready: {self.failure}"

    def begin_request(self, request_id: str | None = None) -> None:
        self.inflight += 1
        if request_id is not None:
            self.active[request_id] = time.monotonic()

    def end_request(self, e2e_s: float | None, request_id: str | None = None) -> None:
        self.inflight -= 1
        self.active.pop(request_id or "", None)
        if e2e_s is not None:
            previous = self.service_time_s
            self.service_time_s = e2e_s if previous is None else previous + _SERVICE_TIME_EWMA * (e2e_s - previous)

    def typical_service_s(self) -> float | None:
        """How long a request takes here: the moving average once requests have finished, else the age of
        the oldest one running (a lower bound), else None."""
        if self.service_time_s is not None:
            return self.service_time_s
        if self.active:
            return time.monotonic() - min(self.active.values())
        return None

    async def abort_all(self) -> None:
        """Abort every running generation: streams end with an error event, the others with a 503."""
        engine = self.engine
        if engine is None:
            return
        for request_id in list(self.active):
            await engine.abort(request_id)

    def expected_queue_wait_s(self, stats: EngineStats) -> float:
        """Rough wait before a new request starts: queued requests drain max_concurrency at a time."""
        max_concurrency = self.settings.config.scheduler.max_concurrency
        if self.service_time_s is None or stats.num_running + stats.num_waiting < max_concurrency:
            return 0.0
        rounds = (stats.num_waiting + 1) / max_concurrency
        return rounds * self.service_time_s
