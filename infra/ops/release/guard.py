"""The shift guard: what `specdeploy rollout` watches while traffic moves, and why it rolls back.

Two checks: the stack's alarms, and the new slot's own metrics. Alarms take minutes to fire
(they average over ``alerting.evaluation_minutes``), so the guard also reads the new slot's
``/metrics`` directly and judges the requests it served during this observe window alone
(counter deltas): the share of 5xx answers against ``alerting.error_rate_critical`` and the
P99 end-to-end latency against ``alerting.p99_latency_s`` — the same signals and thresholds as
the ``SpecdeployHighErrorRate`` and ``SpecdeployHighP99Latency`` alarms.
"""

from __future__ import annotations

import math
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from infra.config import StackConfig
from infra.ops.release.model import ReleaseError
from infra.ops.release.state import StepLog
from infra.ops.release.traffic import AlarmSource
from serving import metric_names as m

Fetch = Callable[[str], str]  # URL -> response body


@dataclass(frozen=True)
class ShiftLimits:
    error_rate: float  # 5xx share of the slot's requests in the window
    p99_latency_s: float  # P99 end-to-end latency in the window
    min_requests: int = 20  # below this many requests in a window, the metrics cannot judge

    @classmethod
    def from_stack(cls, config: StackConfig, min_requests: int = 20) -> ShiftLimits:
        return cls(config.alerting.error_rate_critical, config.alerting.p99_latency_s, min_requests)


@dataclass(frozen=True)
class MetricsSnapshot:
    requests: float = 0.0  # specdeploy_requests_total, every status
    errors: float = 0.0  # the same, status 5xx
    buckets: dict[float, float] = field(default_factory=dict)  # e2e latency: le -> cumulative count

    def since(self, earlier: MetricsSnapshot) -> MetricsSnapshot:
        """Counter deltas; a restarted server (counters went down) counts from zero."""
        def delta(now: float, before: float) -> float:
            return now - before if now >= before else now

        return MetricsSnapshot(
            requests=delta(self.requests, earlier.requests),
            errors=delta(self.errors, earlier.errors),
            buckets={le: delta(count, earlier.buckets.get(le, 0.0)) for le, count in self.buckets.items()},
        )

    @property
    def latency_count(self) -> float:
        return self.buckets.get(math.inf, 0.0)

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests > 0 else 0.0

    def latency_quantile(self, q: float) -> float | None:
        """Prometheus' ``histogram_quantile``: linear within the bucket holding rank q."""
        total = self.latency_count
        if total <= 0:
            return None
        rank = q * total
        lower, below = 0.0, 0.0
        for le in sorted(self.buckets):
            count = self.buckets[le]
            if count >= rank:
                if math.isinf(le):
                    return lower  # beyond the last finite bucket: its bound is all we know
                span = count - below
                return lower + (le - lower) * ((rank - below) / span if span > 0 else 1.0)
            lower, below = le, count
        return lower


def parse_snapshot(text: str) -> MetricsSnapshot:
    from infra.validation import prom

    samples = prom.parse(text)
    requests = errors = 0.0
    buckets: dict[float, float] = {}
    for sample in samples:
        if sample.name == f"{m.REQUESTS}_total":
            requests += sample.value
            if sample.labels.get("status", "").startswith("5"):
                errors += sample.value
        elif sample.name == f"{m.E2E}_bucket" and "le" in sample.labels:
            le = float(sample.labels["le"])  # "+Inf" parses as inf
            buckets[le] = buckets.get(le, 0.0) + sample.value
    return MetricsSnapshot(requests, errors, buckets)


def http_fetch(api_key: str | None = None, timeout_s: float = 5.0) -> Fetch:
    def fetch(url: str) -> str:
        request = urllib.request.Request(url)
        if api_key:
            request.add_header("Authorization", f"Bearer {api_key}")
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body: bytes = response.read()
        return body.decode("utf-8", errors="replace")

    return fetch


class SlotMetrics:
    """The summed /metrics of every endpoint of one slot.

    ``endpoints`` is a list, or a function listing them at each scrape (pods come and go).
    """

    def __init__(self, endpoints: Sequence[str] | Callable[[], Sequence[str]], fetch: Fetch | None = None) -> None:
        self._endpoints = endpoints
        self._fetch = fetch or http_fetch()

    @property
    def endpoints(self) -> list[str]:
        listed = self._endpoints() if callable(self._endpoints) else self._endpoints
        return [e.rstrip("/") for e in listed]

    def snapshot(self) -> MetricsSnapshot:
        total = MetricsSnapshot()
        endpoints = self.endpoints
        if not endpoints:
            raise ValueError("no endpoint of the slot to read")
        for endpoint in endpoints:
            one = parse_snapshot(self._fetch(f"{endpoint}/metrics"))
            buckets = dict(total.buckets)
            for le, count in one.buckets.items():
                buckets[le] = buckets.get(le, 0.0) + count
            total = MetricsSnapshot(total.requests + one.requests, total.errors + one.errors, buckets)
        return total


class ShiftGuard:
    """Watches alarms and the new slot's metrics for one observe window; returns the first breach."""

    def __init__(
        self,
        alarms: AlarmSource | None,
        metrics: SlotMetrics | None,
        limits: ShiftLimits,
        log: StepLog,
        poll_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        say: Callable[[str], None] | None = None,
        say_every_s: float = 60.0,
    ) -> None:
        self.alarms = alarms
        self.metrics = metrics
        self.limits = limits
        self.log = log
        self.poll_s = poll_s
        self._clock = clock
        self._sleep = sleep
        self._say = say  # a progress line for the operator at most every say_every_s
        self._say_every_s = say_every_s

    def preflight(self, slot: str) -> str | None:
        """A reason not to start: an alarm already firing would make any breach unattributable, and
        metrics that cannot be read now would roll back the first step for nothing."""
        firing = self.alarms.firing() if self.alarms is not None else []
        if firing:
            names = ", ".join(f"{a.name} ({a.reason})" for a in firing)
            return f"alarm already firing before any traffic moved: {names}; resolve it first"
        _, reason = self._snapshot(slot)
        return reason

    def observe(self, slot: str, weight: int, seconds: float) -> str | None:
        """Watch for ``seconds``; the breach reason, or None when every check held."""
        baseline, reason = self._snapshot(slot)
        if reason:
            return reason
        deadline = self._clock() + seconds
        last_said = self._clock()
        while True:
            reason = self._check_alarms()
            window = None
            if reason is None and self.metrics is not None and baseline is not None:
                now, reason = self._snapshot(slot)
                if now is not None:
                    window = now.since(baseline)
                    reason = self._judge(slot, window)
            remaining = deadline - self._clock()
            self.log.write("guard_check", slot=slot, weight=weight, ok=reason is None, reason=reason,
                           **self._window_fields(window), remaining_s=round(max(remaining, 0.0), 1))
            if reason is not None or remaining <= 0:
                return reason
            if self._say is not None and self._clock() - last_said >= self._say_every_s:
                last_said = self._clock()
                self._say(f"  {slot} {weight}%: checks ok{self._describe(window)}, {remaining:.0f}s left")
            self._sleep(min(self.poll_s, remaining))

    def _check_alarms(self) -> str | None:
        if self.alarms is None:
            return None
        firing = self.alarms.firing()
        if not firing:
            return None
        first = firing[0]
        return f"alarm {first.name} is ALARM: {first.reason}"

    def _snapshot(self, slot: str) -> tuple[MetricsSnapshot | None, str | None]:
        if self.metrics is None:
            return None, None
        try:
            return self.metrics.snapshot(), None
        except (OSError, ValueError, ReleaseError) as exc:
            return None, f"cannot read {slot}'s /metrics: {exc}"

    def _judge(self, slot: str, window: MetricsSnapshot) -> str | None:
        t = self.limits
        if window.requests >= t.min_requests and window.error_rate > t.error_rate:
            return (f"{slot} error rate {window.error_rate:.2%} over {window.requests:.0f} requests "
                    f"exceeds {t.error_rate:.2%} (alerting.error_rate_critical)")
        p99 = window.latency_quantile(0.99)
        if window.latency_count >= t.min_requests and p99 is not None and p99 > t.p99_latency_s:
            return f"{slot} P99 latency {p99:.2f}s exceeds {t.p99_latency_s:g}s (alerting.p99_latency_s)"
        return None

    @staticmethod
    def _describe(window: MetricsSnapshot | None) -> str:
        if window is None:
            return ""
        p99 = window.latency_quantile(0.99)
        latency = "" if p99 is None else f", P99 {p99:.2f}s"
        return f" ({window.requests:.0f} requests, {window.error_rate:.2%} errors{latency})"

    @staticmethod
    def _window_fields(window: MetricsSnapshot | None) -> dict[str, float | None]:
        if window is None:
            return {}
        p99 = window.latency_quantile(0.99)
        return {"requests": window.requests, "error_rate": round(window.error_rate, 5),
                "p99_s": None if p99 is None else round(p99, 4)}
