"""Load generator: streaming requests against an OpenAI-compatible endpoint, measured per request.

Two arrival models, as in vLLM's benchmarks:

- closed loop: ``concurrency`` workers, each sends its next request when the previous one ends;
  measures what the server does at a fixed number of requests in flight;
- open loop: requests arrive as a Poisson process of ``rate`` per second whatever the server
  does; queueing shows up as TTFT instead of being hidden by the client slowing down.

Per request: TTFT (first non-empty streamed chunk), E2E (end of stream), inter-token latencies
between chunks, output tokens (the server's usage, else chunk count), TPOT = (E2E - TTFT) /
(output tokens - 1). A metrics sampler polls /metrics during a phase (memory, queue, KV blocks).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from infra.validation import prom
from infra.validation.stats import distribution, tpot
from serving import metric_names as names

# A request whose stream stalls longer than this between chunks is counted as failed.
DEFAULT_TIMEOUT_S = 300.0
STATUS_CONNECTION = 0  # no HTTP status: connection refused, reset or timed out
STATUS_STREAM_ERROR = 599  # the stream started (200) but ended in an error event or without [DONE]


@dataclass(frozen=True)
class Workload:
    """The content of one request."""

    category: str  # prompt set: code, chat, extraction, writing
    prompt: str  # completion prompt (used when messages is empty)
    max_tokens: int
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) pairs: sent to the chat endpoint

    def body(self, model: str, stream: bool = True) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) of a greedy request for this workload."""
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "temperature": 0.0, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.messages:
            body["messages"] = [{"role": role, "content": content} for role, content in self.messages]
            return "/v1/chat/completions", body
        body["prompt"] = self.prompt
        return "/v1/completions", body


def load_workloads(categories: Sequence[str] | None = None, max_tokens: int | None = None) -> list[Workload]:
    """The bundled prompt sets (serving/demo/prompts) as workloads, max_tokens capped."""
    from serving.demo.prompts import CATEGORIES, load_prompts

    workloads = []
    for category in categories or CATEGORIES:
        for p in load_prompts(category):
            limit = p.max_tokens if max_tokens is None else min(p.max_tokens, max_tokens)
            messages = tuple((m["role"], m["content"]) for m in p.messages)
            workloads.append(Workload(p.category, p.prompt, limit, messages))
    return workloads


@dataclass
class RequestRecord:
    category: str
    start_s: float  # when it was sent, seconds since the phase began
    status: int  # HTTP status; STATUS_CONNECTION / STATUS_STREAM_ERROR for failures without one
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive non-empty chunks
    finish_reason: str | None = None
    error: str | None = None  # first 200 characters of the error message
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.e2e_s is None:
            return None
        return tpot(self.e2e_s, self.ttft_s, self.output_tokens)


@dataclass(frozen=True)
class MetricsPoint:
    t_s: float  # seconds since the phase began
    rss_bytes: float | None
    gpu_memory_bytes: float | None
    waiting: float | None
    running: float | None
    kv_blocks_used: float | None


@dataclass(frozen=True)
class SloTargets:
    """Per-request targets a request must meet to count towards goodput."""

    ttft_s: float
    tpot_s: float
    e2e_s: float

    @classmethod
    def from_stack(cls, slo: Any) -> SloTargets:
        return cls(ttft_s=slo.ttft_p99_ms / 1000, tpot_s=slo.tpot_p99_ms / 1000, e2e_s=slo.e2e_p99_s)

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok or r.ttft_s is None or r.e2e_s is None:
            return False
        per_token = r.tpot_s
        return r.ttft_s <= self.ttft_s and r.e2e_s <= self.e2e_s and (per_token is None or per_token <= self.tpot_s)


@dataclass
class Phase:
    """One measured stretch of load with fixed settings."""

    name: str
    mode: str  # "closed" or "open"
    concurrency: int | None  # closed loop
    rate_rps: float | None  # open loop
    started_at: float  # unix time
    duration_s: float
    records: list[RequestRecord]
    samples: list[MetricsPoint] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)  # e.g. {"spec": "on", "prompt_set": "code"}

    @property
    def ok_records(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    def errors_by_status(self) -> dict[str, int]:
        counts = Counter("connection" if r.status == STATUS_CONNECTION else str(r.status)
                         for r in self.records if not r.ok)
        return dict(sorted(counts.items()))

    def summary(self, slo: SloTargets | None = None) -> dict[str, Any]:
        ok = self.ok_records
        duration = max(self.duration_s, 1e-9)
        tokens = sum(r.output_tokens for r in ok)
        itl = [gap for r in ok for gap in r.itl_s]
        peak_rss = max((p.rss_bytes for p in self.samples if p.rss_bytes is not None), default=None)
        peak_gpu = max((p.gpu_memory_bytes for p in self.samples if p.gpu_memory_bytes is not None), default=None)
        max_waiting = max((p.waiting for p in self.samples if p.waiting is not None), default=None)
        out: dict[str, Any] = {
            "name": self.name,
            "mode": self.mode,
            "concurrency": self.concurrency,
            "rate_rps": self.rate_rps,
            "labels": self.labels,
            "duration_s": self.duration_s,
            "requests": len(self.records),
            "completed": len(ok),
            "errors": len(self.records) - len(ok),
            "errors_by_status": self.errors_by_status(),
            "error_rate": (len(self.records) - len(ok)) / len(self.records) if self.records else 0.0,
            "request_throughput_rps": len(ok) / duration,
            "output_tokens": tokens,
            "token_throughput_tps": tokens / duration,
            "ttft_s": distribution([r.ttft_s for r in ok if r.ttft_s is not None]).as_dict(),
            "tpot_s": distribution([t for r in ok if (t := r.tpot_s) is not None]).as_dict(),
            "itl_s": distribution(itl).as_dict(),
            "e2e_s": distribution([r.e2e_s for r in ok if r.e2e_s is not None]).as_dict(),
            "peak_rss_bytes": peak_rss,
            "peak_gpu_memory_bytes": peak_gpu,
            "max_queue_length": max_waiting,
        }
        if slo is not None:
            good = sum(1 for r in self.records if slo.met_by(r))
            out["goodput_rps"] = good / duration
            out["goodput_share"] = good / len(self.records) if self.records else 0.0
        return out

    def to_json(self, slo: SloTargets | None = None, with_text: bool = False) -> dict[str, Any]:
        records = []
        for r in self.records:
            item = asdict(r)
            item["tpot_s"] = r.tpot_s
            if not with_text:
                item.pop("text")
            records.append(item)
        return {"summary": self.summary(slo), "records": records, "samples": [asdict(p) for p in self.samples]}


def poisson_arrivals(rate_rps: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times in [0, duration) of a Poisson process: exponential gaps of mean 1/rate."""
    if rate_rps <= 0:
        raise ValueError(f"rate must be positive, got {rate_rps}")
    times: list[float] = []
    t = rng.expovariate(rate_rps)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate_rps)
    return times


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _error_message(raw: bytes) -> str:
    try:
        payload = json.loads(raw)
        message = payload.get("error", {}).get("message") if isinstance(payload, dict) else None
    except (ValueError, AttributeError):
        message = None
    return str(message or raw[:200].decode("utf-8", "replace"))[:200]


def completion_text(payload: dict[str, Any]) -> str:
    """The generated text of a non-streaming completion or chat completion response."""
    choice = payload["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


def _chunk_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return str(choice.get("text") or "")
    return str((choice.get("delta") or {}).get("content") or "")


async def stream_request(client: httpx.AsyncClient, workload: Workload, model: str, phase_start: float,
                         api_key: str | None = None) -> RequestRecord:
    """Send one streaming request and time it."""
    path, body = workload.body(model)
    sent = time.perf_counter()
    record = RequestRecord(workload.category, sent - phase_start, STATUS_CONNECTION)
    first: float | None = None
    last: float | None = None
    chunks = 0
    pieces: list[str] = []
    done = False
    try:
        async with client.stream("POST", path, json=body, headers=auth_headers(api_key)) as response:
            record.status = response.status_code
            if response.status_code != 200:
                record.error = _error_message(await response.aread())
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.status = STATUS_STREAM_ERROR
                    record.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    break
                if chunk.get("usage"):
                    record.output_tokens = int(chunk["usage"].get("completion_tokens", 0))
                for choice in chunk.get("choices") or []:
                    text = _chunk_text(choice)
                    if text:
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        elif last is not None:
                            record.itl_s.append(now - last)
                        last = now
                        chunks += 1
                        pieces.append(text)
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        if record.status == 200:
            record.status = STATUS_STREAM_ERROR
        record.error = f"{type(exc).__name__}: {exc}"[:200]
        return record
    end = time.perf_counter()
    if record.status == 200 and not done and record.error is None:
        record.status = STATUS_STREAM_ERROR
        record.error = "stream ended without [DONE]"
    record.text = "".join(pieces)
    record.ttft_s = None if first is None else first - sent
    record.e2e_s = end - sent
    if record.output_tokens == 0:
        record.output_tokens = chunks
    return record


async def scrape(client: httpx.AsyncClient, api_key: str | None = None) -> list[prom.Sample]:
    response = await client.get("/metrics", headers=auth_headers(api_key))
    response.raise_for_status()
    return prom.parse(response.text)


def metrics_point(samples: list[prom.Sample], t_s: float) -> MetricsPoint:
    return MetricsPoint(
        t_s=t_s,
        rss_bytes=prom.value(samples, names.RSS_BYTES),
        gpu_memory_bytes=prom.value(samples, names.GPU_MEMORY_USED),
        waiting=prom.value(samples, names.WAITING),
        running=prom.value(samples, names.RUNNING),
        kv_blocks_used=prom.value(samples, names.KV_BLOCKS_USED),
    )


ProgressHook = Callable[[int], None]  # called with the number of requests just finished


class LoadGenerator:
    """One endpoint, one HTTP connection pool; run phases with ``closed_loop`` / ``open_loop``."""

    def __init__(self, endpoint: str, api_key: str | None = None, model: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, sample_interval_s: float = 1.0, progress: bool = True) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.api_key = api_key
        self.model = model
        self.timeout_s = timeout_s
        self.sample_interval_s = sample_interval_s
        self.progress = progress
        self._client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> LoadGenerator:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        self._client = httpx.AsyncClient(base_url=self.endpoint, timeout=self.timeout_s, limits=limits)
        if self.model is None:
            self.model = await self.served_model()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.aclose()

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("LoadGenerator used outside `async with`")
        return self._client

    async def served_model(self) -> str:
        response = await self.client.get("/v1/models", headers=auth_headers(self.api_key))
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])

    async def _sample_metrics(self, phase_start: float, out: list[MetricsPoint], stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                samples = await scrape(self.client, self.api_key)
                out.append(metrics_point(samples, time.perf_counter() - phase_start))
            except (httpx.HTTPError, ValueError):
                pass  # a missed sample is a gap in a plot, not a failure of the phase
            try:
                await asyncio.wait_for(stop.wait(), self.sample_interval_s)
            except TimeoutError:
                pass

    async def closed_loop(self, name: str, workloads: Sequence[Workload], concurrency: int, *,
                          duration_s: float | None = None, num_requests: int | None = None,
                          labels: dict[str, str] | None = None) -> Phase:
        """``concurrency`` workers cycle through ``workloads`` until ``num_requests`` were sent or
        ``duration_s`` passed (requests in flight at the deadline are completed and counted)."""
        if duration_s is None and num_requests is None:
            raise ValueError("closed_loop needs duration_s or num_requests")
        if not workloads:
            raise ValueError("closed_loop needs at least one workload")
        assert self.model is not None
        records: list[RequestRecord] = []
        next_index = 0
        start = time.perf_counter()
        deadline = start + duration_s if duration_s is not None else float("inf")

        async def worker(tick: ProgressHook) -> None:
            nonlocal next_index
            while time.perf_counter() < deadline and (num_requests is None or next_index < num_requests):
                workload = workloads[next_index % len(workloads)]
                next_index += 1
                assert self.model is not None
                records.append(await stream_request(self.client, workload, self.model, start, self.api_key))
                tick(1)

        total = num_requests if num_requests is not None else None
        phase = await self._run(name, start, total, duration_s,
                                lambda tick: [worker(tick) for _ in range(concurrency)])
        phase.records = records
        phase.mode, phase.concurrency, phase.labels = "closed", concurrency, dict(labels or {})
        return phase

    async def open_loop(self, name: str, workloads: Sequence[Workload], rate_rps: float, duration_s: float, *,
                        seed: int = 0, labels: dict[str, str] | None = None) -> Phase:
        """Requests arrive as a Poisson process at ``rate_rps`` for ``duration_s``; all are awaited."""
        arrivals = poisson_arrivals(rate_rps, duration_s, random.Random(seed))
        records: list[RequestRecord] = []
        start = time.perf_counter()

        async def one(at: float, workload: Workload, tick: ProgressHook) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            assert self.model is not None
            records.append(await stream_request(self.client, workload, self.model, start, self.api_key))
            tick(1)

        phase = await self._run(name, start, len(arrivals), None,
                                lambda tick: [one(at, workloads[i % len(workloads)], tick)
                                              for i, at in enumerate(arrivals)])
        phase.records = records
        phase.mode, phase.rate_rps, phase.labels = "open", rate_rps, dict(labels or {})
        return phase

    async def _run(self, name: str, start: float, total: int | None, duration_s: float | None,
                   make: Callable[[ProgressHook], list[Any]]) -> Phase:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        samples: list[MetricsPoint] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(self._sample_metrics(start, samples, stop))
        started_at = time.time()
        columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed} requests"),
                   TimeElapsedColumn())
        with Progress(*columns, transient=True, disable=not self.progress) as bar:
            task = bar.add_task(name, total=total if total is not None else duration_s)
            done = 0
            t0 = time.perf_counter()

            def tick(n: int) -> None:
                nonlocal done
                done += n
                completed = done if total is not None else min(time.perf_counter() - t0, duration_s or 0.0)
                bar.update(task, completed=completed)

            try:
                await asyncio.gather(*make(tick))
            finally:
                stop.set()
                await sampler
        duration = time.perf_counter() - start
        return Phase(name=name, mode="", concurrency=None, rate_rps=None, started_at=started_at,
                     duration_s=duration, records=[], samples=samples)


def run(coro: Any) -> Any:
    """Run a load-generator coroutine from synchronous code (pytest fixtures, the CLI)."""
    return asyncio.run(coro)
