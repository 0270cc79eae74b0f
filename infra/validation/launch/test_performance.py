"""3. Performance baseline: a concurrency sweep, Poisson load, and the SLOs at target concurrency.

Guides: 七.2 (P50/P99 latency, tokens/s, peak memory, queue length as the capacity baseline) and
八.2 (TTFT, per-token speed, throughput and latency per concurrency level against the targets;
15 minutes or more of sustained load: the standard profile's sustained run).
"""

from __future__ import annotations

from typing import Any

import pytest

from infra.validation.record import slo_figures

pytestmark = pytest.mark.launch

_FIGURES = ["P99 TTFT", "P99 TPOT", "P99 E2E", "token throughput", "error rate"]


def test_sweep_level_is_served_without_errors(sweep: dict[int, Any], sweep_level: int) -> None:
    summary = sweep[sweep_level].summary()
    assert summary["completed"] > 0, f"no request completed at concurrency {sweep_level}"
    assert summary["errors"] == 0, f"errors at concurrency {sweep_level}: {summary['errors_by_status']}"


def test_sweep_level_records_memory_and_queue_length(sweep: dict[int, Any], sweep_level: int) -> None:
    summary = sweep[sweep_level].summary()
    assert summary["peak_rss_bytes"] is not None, "no process memory read from /metrics during the phase"
    assert summary["max_queue_length"] is not None, "no queue length read from /metrics during the phase"


@pytest.mark.parametrize("figure", _FIGURES)
def test_sustained_load_meets_the_slo(sustained: Any, launch_run: Any, figure: str) -> None:
    measured = {f.name: f for f in slo_figures(sustained.summary(launch_run.targets), launch_run.slo)}[figure]
    assert measured.passed, (f"{figure} at concurrency {sustained.concurrency}: measured {measured.measured} "
                             f"{measured.unit}, target {'>=' if measured.higher_is_better else '<='} "
                             f"{measured.target:g} {measured.unit}")


def test_sustained_load_lasts_the_profile_duration(sustained: Any, profile: Any) -> None:
    assert sustained.duration_s >= profile.sustained_s, f"{sustained.duration_s:.0f}s < {profile.sustained_s:.0f}s"


def test_poisson_load_below_capacity_is_served_without_errors(open_loop: Any) -> None:
    summary = open_loop.summary()
    assert summary["requests"] > 0, "the Poisson phase sent no request (rate too low for its duration)"
    assert summary["errors"] == 0, f"errors under Poisson arrivals: {summary['errors_by_status']}"


def test_peak_gpu_memory_stays_within_the_configured_share(sustained: Any, stack: Any, http: Any) -> None:
    from infra.validation import prom
    from serving import metric_names

    peak = sustained.summary()["peak_gpu_memory_bytes"]
    total = prom.value(prom.parse(http.get("/metrics").text), metric_names.GPU_MEMORY_TOTAL)
    if peak is None or not total:
        pytest.skip("no GPU memory series: CPU deployment")
    share = stack.service.max_memory_utilization
    assert peak <= share * total * 1.02, f"GPU memory peaked at {peak / total:.1%}, configured share {share:.0%}"
