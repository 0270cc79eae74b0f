"""Prometheus series of one server, all named in ``serving.metric_names``.

Request-level series (latency histograms, request counts) are recorded as requests finish;
engine-level series are refreshed from ``engine.stats()`` at every scrape, so /metrics always
shows the engine as it is now.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from serving import metric_names as names
from serving.engine.types import EngineStats

# Latency buckets (seconds) wide enough for a CPU demo model and a GPU fleet alike.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _counter_name(full: str) -> str:
    # prometheus-client appends `_total` to counters itself.
    return full.removesuffix("_total")


# (SpecStats field, series, help) of the counters a speculating server exports
_SPEC_COUNTERS = (
    ("num_drafts", names.SPEC_DRAFTS, "Verification rounds that carried draft tokens"),
    ("num_draft_tokens", names.SPEC_DRAFT_TOKENS, "Draft tokens verified"),
    ("num_accepted_tokens", names.SPEC_ACCEPTED_TOKENS, "Draft tokens accepted"),
    ("guard_cycles", names.SPEC_GUARD_CYCLES, "Decoding steps the speculation guard decided (zero with a fixed k)"),
    ("guard_vetoed_cycles", names.SPEC_GUARD_VETOED_CYCLES,
     "Guard steps run without drafts: drafting measured slower at that load"),
    ("guard_plain_cycles", names.SPEC_GUARD_PLAIN_CYCLES, "Guard steps run without drafts to measure plain decoding"),
    ("guard_vetoes", names.SPEC_GUARD_VETOES, "Times a load turned speculation off"),
)


class ServerMetrics:
    def __init__(self, speculative: bool) -> None:
        disable_created_metrics()  # `_created` series double the page and no dashboard reads them
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter(_counter_name(names.REQUESTS), "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=reg)
        self.ttft = Histogram(names.TTFT, "Time from request receipt to the first generated token",
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram(names.TPOT, "(E2E - TTFT) / (output tokens - 1) per request",
                              buckets=_TOKEN_BUCKETS, registry=reg)
        self.itl = Histogram(names.INTER_TOKEN, "Time between consecutive streamed chunks",
                             buckets=_TOKEN_BUCKETS, registry=reg)
        self.e2e = Histogram(names.E2E, "Time from request receipt to the last token",
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.queue_time = Histogram(names.QUEUE_TIME, "Time a request waited before its first engine step",
                                    buckets=_LATENCY_BUCKETS, registry=reg)
        self.step_time = Histogram(names.STEP_TIME, "Duration of one engine step",
                                   buckets=_TOKEN_BUCKETS, registry=reg)
        self.running = Gauge(names.RUNNING, "Requests holding KV blocks", registry=reg)
        self.waiting = Gauge(names.WAITING, "Requests queued in the engine", registry=reg)
        self.kv_used = Gauge(names.KV_BLOCKS_USED, "KV cache blocks in use", registry=reg)
        self.kv_total = Gauge(names.KV_BLOCKS_TOTAL, "KV cache blocks in all", registry=reg)
        self.ready = Gauge(names.READY, "1 when /ready answers 200", registry=reg)
        self.rss = Gauge(names.RSS_BYTES, "Resident memory of the server process", registry=reg)
        self.prompt_tokens = Counter(_counter_name(names.PROMPT_TOKENS), "Prompt tokens prefilled", registry=reg)
        self.generation_tokens = Counter(_counter_name(names.GENERATION_TOKENS), "Tokens generated", registry=reg)
        self.preemptions = Counter(_counter_name(names.PREEMPTIONS), "Requests preempted (recomputed)",
                                   registry=reg)
        self.step_failures = Counter(_counter_name(names.STEP_FAILURES),
                                     "Engine steps that raised (their requests failed with 503, the engine went on)",
                                     registry=reg)
        self.prefix_queries = Counter(_counter_name(names.PREFIX_CACHE_QUERIES),
                                      "Prompt tokens looked up in the prefix cache", registry=reg)
        self.prefix_hits = Counter(_counter_name(names.PREFIX_CACHE_HITS),
                                   "Prompt tokens found in the prefix cache (prefill skipped)", registry=reg)
        # speculation on: one counter per SpecStats total, keyed by its field
        self.spec_counters = {field: Counter(_counter_name(name), help_text, registry=reg)
                              for field, name, help_text in _SPEC_COUNTERS} if speculative else {}
        self.gpu_used: Gauge | None = None
        self.gpu_total: Gauge | None = None
        self.gpu_utilization: Gauge | None = None
        self._seen: dict[str, float] = {}  # engine totals already turned into counter increments
        self._steps_seen = 0

    def enable_gpu(self) -> None:
        if self.gpu_used is None:
            self.gpu_used = Gauge(names.GPU_MEMORY_USED, "GPU memory in use on this device", registry=self.registry)
            self.gpu_total = Gauge(names.GPU_MEMORY_TOTAL, "GPU memory of this device", registry=self.registry)
            self.gpu_utilization = Gauge(names.GPU_UTILIZATION, "GPU busy share over the last sample period (NVML)",
                                         registry=self.registry)

    def _advance(self, counter: Counter, key: str, total: float) -> None:
        delta = total - self._seen.get(key, 0.0)
        if delta > 0:
            counter.inc(delta)
        self._seen[key] = total

    def refresh(self, stats: EngineStats | None, ready: bool) -> None:
        """Bring engine-level series up to date (called by the /metrics handler)."""
        self.ready.set(1.0 if ready else 0.0)
        self.rss.set(_resident_bytes())
        if self.gpu_used is not None and self.gpu_total is not None:
            used, total = _gpu_memory()
            self.gpu_used.set(used)
            self.gpu_total.set(total)
            if self.gpu_utilization is not None:
                self.gpu_utilization.set(_gpu_utilization())
        if stats is None:
            return
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_total.set(stats.kv_blocks_total)
        self._advance(self.prompt_tokens, "prompt", stats.prompt_tokens_total)
        self._advance(self.generation_tokens, "generation", stats.generation_tokens_total)
        self._advance(self.preemptions, "preemptions", stats.preemptions_total)
        self._advance(self.prefix_queries, "prefix_queries", stats.prefix_cache_queries_total)
        self._advance(self.step_failures, "step_failures", stats.step_failures_total)
        self._advance(self.prefix_hits, "prefix_hits", stats.prefix_cache_hits_total)
        for field, counter in self.spec_counters.items():
            self._advance(counter, field, getattr(stats.spec, field))
        new_steps = min(stats.steps_total - self._steps_seen, len(stats.recent_step_durations_s))
        if new_steps > 0:
            for seconds in stats.recent_step_durations_s[-new_steps:]:
                self.step_time.observe(seconds)
        self._steps_seen = stats.steps_total

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _resident_bytes() -> float:
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return float(int(fh.read().split()[1]) * _PAGE_SIZE)
    except (OSError, ValueError, IndexError):
        import resource

        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _gpu_memory() -> tuple[float, float]:
    torch: Any
    import torch

    free, total = torch.cuda.mem_get_info()
    return float(total - free), float(total)


def _gpu_utilization() -> float:
    """0..1 from NVML through torch; NaN where NVML (pynvml) is not installed."""
    import torch

    try:
        return float(torch.cuda.utilization()) / 100.0
    except Exception:  # ModuleNotFoundError (pynvml) or an NVML error: report unknown, never fail a scrape
        return float("nan")
