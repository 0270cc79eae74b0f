"""The shift guard: counter deltas, P99 from histogram buckets, alarm and metric breaches."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from infra.ops.release.guard import MetricsSnapshot, ShiftGuard, ShiftLimits, SlotMetrics, parse_snapshot
from infra.ops.release.state import StepLog
from infra.ops.release.traffic import FiringAlarm
from serving import metric_names as m

PAGE = f"""\
# HELP specdeploy_requests_total HTTP requests
{m.REQUESTS}_total{{endpoint="/v1/completions",status="200"}} 90
{m.REQUESTS}_total{{endpoint="/v1/completions",status="503"}} 6
{m.REQUESTS}_total{{endpoint="/v1/completions",status="429"}} 4
{m.E2E}_bucket{{le="1.0"}} 50
{m.E2E}_bucket{{le="10.0"}} 99
{m.E2E}_bucket{{le="+Inf"}} 100
"""


def test_snapshot_counts_5xx_but_not_4xx() -> None:
    snap = parse_snapshot(PAGE)
    assert (snap.requests, snap.errors) == (100, 6)


def test_p99_interpolates_like_histogram_quantile() -> None:
    snap = parse_snapshot(PAGE)
    assert snap.latency_quantile(0.5) == pytest.approx(1.0)
    assert snap.latency_quantile(0.99) == pytest.approx(10.0)
    assert snap.latency_quantile(0.75) == pytest.approx(1.0 + 9.0 * 25 / 49)


def test_quantile_beyond_the_last_bucket_is_its_bound() -> None:
    assert MetricsSnapshot(buckets={1.0: 0, math.inf: 10}).latency_quantile(0.99) == 1.0


def test_window_is_the_delta_and_survives_a_restart() -> None:
    before = MetricsSnapshot(100, 5, {1.0: 50, math.inf: 100})
    after = MetricsSnapshot(150, 5, {1.0: 90, math.inf: 150})
    assert after.since(before) == MetricsSnapshot(50, 0, {1.0: 40, math.inf: 50})
    restarted = MetricsSnapshot(10, 1, {1.0: 10, math.inf: 10})
    assert restarted.since(before).requests == 10


class Alarms:
    def __init__(self) -> None:
        self.firing_now: list[FiringAlarm] = []

    def watched(self) -> list[str]:
        return ["prod-SpecdeployHighErrorRate"]

    def firing(self) -> list[FiringAlarm]:
        return list(self.firing_now)


class Pages:
    """A scripted /metrics: each scrape returns the next page."""

    def __init__(self, *pages: str) -> None:
        self.pages = list(pages)

    def __call__(self, url: str) -> str:
        return self.pages.pop(0) if len(self.pages) > 1 else self.pages[0]


def page(ok: int, errors: int, slow: int = 0) -> str:
    total = ok + errors
    return (f'{m.REQUESTS}_total{{status="200"}} {ok}\n{m.REQUESTS}_total{{status="500"}} {errors}\n'
            f'{m.E2E}_bucket{{le="1.0"}} {total - slow}\n{m.E2E}_bucket{{le="40.0"}} {total}\n'
            f'{m.E2E}_bucket{{le="+Inf"}} {total}\n')


def watcher(tmp_path: Path, alarms: Alarms | None, fetch: Pages | None) -> ShiftGuard:
    clock = iter(range(1000))
    metrics = SlotMetrics(["http://10.0.1.23:8000"], fetch) if fetch else None
    return ShiftGuard(alarms, metrics, ShiftLimits(error_rate=0.01, p99_latency_s=30, min_requests=20),
                       StepLog(tmp_path / "log.jsonl", "prod"), poll_s=1, clock=lambda: float(next(clock)),
                       sleep=lambda s: None)


def test_quiet_window_passes(tmp_path: Path) -> None:
    assert watcher(tmp_path, Alarms(), Pages(page(100, 0), page(200, 1))).observe("green", 10, 3) is None


def test_alarm_breaches(tmp_path: Path) -> None:
    alarms = Alarms()
    alarms.firing_now = [FiringAlarm("prod-SpecdeployHighErrorRate", "Threshold Crossed")]
    reason = watcher(tmp_path, alarms, None).observe("green", 10, 3)
    assert reason == "alarm prod-SpecdeployHighErrorRate is ALARM: Threshold Crossed"


def test_error_rate_in_the_window_breaches(tmp_path: Path) -> None:
    reason = watcher(tmp_path, None, Pages(page(100, 0), page(150, 10))).observe("green", 50, 3)
    assert reason is not None and "error rate 16.67% over 60 requests" in reason


def test_few_requests_are_not_judged(tmp_path: Path) -> None:
    assert watcher(tmp_path, None, Pages(page(0, 0), page(5, 5))).observe("green", 10, 3) is None


def test_slow_window_breaches_on_p99(tmp_path: Path) -> None:
    reason = watcher(tmp_path, None, Pages(page(0, 0), page(100, 0, slow=50))).observe("green", 10, 3)
    assert reason is not None and "P99 latency" in reason


def test_unreadable_metrics_breach(tmp_path: Path) -> None:
    def down(url: str) -> str:
        raise ConnectionRefusedError("connection refused")

    reason = watcher(tmp_path, None, down).observe("green", 10, 3)  # type: ignore[arg-type]
    assert reason is not None and "cannot read green's /metrics" in reason


def test_firing_alarm_blocks_the_start(tmp_path: Path) -> None:
    alarms = Alarms()
    alarms.firing_now = [FiringAlarm("prod-SpecdeployQueueBacklog", "Threshold Crossed")]
    assert "already firing" in (watcher(tmp_path, alarms, None).preflight("green") or "")


def test_unreadable_metrics_block_the_start(tmp_path: Path) -> None:
    def down(url: str) -> str:
        raise ConnectionRefusedError("connection refused")

    assert "cannot read green's /metrics" in (watcher(tmp_path, None, down).preflight("green") or "")  # type: ignore[arg-type]
    assert watcher(tmp_path, None, Pages(page(1, 0))).preflight("green") is None


def test_reads_the_real_servers_exposition() -> None:
    """The server's own /metrics page (serving.api.metrics), not a hand-written one."""
    from serving.api.metrics import ServerMetrics

    server = ServerMetrics(speculative=False)
    for status, count in (("200", 97), ("500", 2), ("503", 1), ("429", 5)):
        server.requests.labels(endpoint="/v1/chat/completions", status=status).inc(count)
    for seconds in [0.3] * 98 + [35.0] * 2:
        server.e2e.observe(seconds)
    snap = parse_snapshot(server.render().decode())
    assert (snap.requests, snap.errors) == (105, 3)
    assert snap.latency_count == 100
    assert snap.latency_quantile(0.5) == pytest.approx(0.4, abs=0.11)
    assert 20 < (snap.latency_quantile(0.99) or 0) <= 40


def test_progress_lines_while_watching(tmp_path: Path) -> None:
    lines: list[str] = []
    guard = watcher(tmp_path, None, Pages(page(0, 0), page(100, 1)))
    guard._say, guard._say_every_s = lines.append, 1.0
    assert guard.observe("green", 10, 5) is None
    assert lines and lines[0].startswith("  green 10%: checks ok (101 requests, 0.99% errors, P99 ")
