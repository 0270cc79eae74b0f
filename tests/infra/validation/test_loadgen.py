from __future__ import annotations

import random
from typing import Any

import pytest

from infra.validation.loadgen import (
    LoadGenerator,
    Phase,
    RequestRecord,
    SloTargets,
    Workload,
    load_workloads,
    poisson_arrivals,
    run,
)


def test_poisson_arrivals_have_the_requested_rate() -> None:
    times = poisson_arrivals(5.0, 2000.0, random.Random(1))
    assert len(times) / 2000.0 == pytest.approx(5.0, rel=0.03)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.2, rel=0.03)


def test_poisson_gaps_are_exponential() -> None:
    # For an exponential distribution about 36.8 % of gaps exceed the mean.
    times = poisson_arrivals(2.0, 5000.0, random.Random(2))
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert sum(g > 0.5 for g in gaps) / len(gaps) == pytest.approx(0.368, abs=0.02)


def test_poisson_arrivals_are_reproducible_with_a_seed() -> None:
    assert poisson_arrivals(3.0, 10.0, random.Random(7)) == poisson_arrivals(3.0, 10.0, random.Random(7))


def test_poisson_arrivals_need_a_positive_rate() -> None:
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 10.0, random.Random(0))


def _record(e2e: float, ttft: float, tokens: int, status: int = 200, start: float = 0.0) -> RequestRecord:
    return RequestRecord("code", start, status, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens,
                         error=None if status == 200 else "boom")


def test_phase_summary_counts_throughput_errors_and_goodput() -> None:
    records = [_record(1.0, 0.1, 10), _record(2.0, 0.2, 10), _record(3.0, 2.5, 10), _record(0, 0, 0, status=429)]
    phase = Phase("p", "closed", 2, None, 0.0, 10.0, records)
    summary = phase.summary(SloTargets(ttft_s=1.0, tpot_s=0.5, e2e_s=5.0))
    assert summary["completed"] == 3 and summary["errors"] == 1
    assert summary["errors_by_status"] == {"429": 1}
    assert summary["token_throughput_tps"] == pytest.approx(3.0)
    assert summary["request_throughput_rps"] == pytest.approx(0.3)
    assert summary["goodput_rps"] == pytest.approx(0.2)  # the third request misses the TTFT target
    assert summary["tpot_s"]["p50"] == pytest.approx((1.0 - 0.1) / 9)  # median of 0.1, 0.2, 0.056


def test_workloads_cover_every_prompt_set_and_cap_max_tokens() -> None:
    workloads = load_workloads(max_tokens=8)
    assert {w.category for w in workloads} == {"code", "chat", "extraction", "writing"}
    assert max(w.max_tokens for w in workloads) <= 8


def test_chat_workload_goes_to_the_chat_endpoint() -> None:
    path, body = Workload("chat", "hi", 4, (("user", "hi"),)).body("m")
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.0


def test_closed_loop_measures_every_request_against_a_server(serve_fake: Any) -> None:
    workloads = [Workload("code", "def f():", 8), Workload("chat", "", 8, (("user", "hello"),))]

    async def measure() -> Phase:
        async with LoadGenerator(endpoint, progress=False, sample_interval_s=0.05) as gen:
            return await gen.closed_loop("t", workloads, 2, num_requests=6)

    with serve_fake() as (endpoint, _):
        phase = run(measure())
    assert len(phase.records) == 6 and all(r.ok for r in phase.records)
    assert all(r.output_tokens == 8 and len(r.itl_s) == 7 for r in phase.records)
    assert all(r.ttft_s is not None and r.e2e_s is not None and r.ttft_s <= r.e2e_s for r in phase.records)
    assert {r.category for r in phase.records} == {"code", "chat"}
    assert phase.samples and phase.samples[0].kv_blocks_used is not None


def test_open_loop_sends_the_poisson_schedule(serve_fake: Any) -> None:
    async def measure() -> Phase:
        async with LoadGenerator(endpoint, progress=False) as gen:
            return await gen.open_loop("t", [Workload("code", "x", 4)], 20.0, 1.0, seed=3)

    with serve_fake() as (endpoint, _):
        phase = run(measure())
    assert len(phase.records) == len(poisson_arrivals(20.0, 1.0, random.Random(3)))
    assert phase.rate_rps == 20.0 and all(r.ok for r in phase.records)


def test_refused_requests_are_recorded_with_status_and_message(serve_fake: Any) -> None:
    async def measure() -> Phase:
        async with LoadGenerator(endpoint, progress=False) as gen:
            return await gen.closed_loop("t", [Workload("code", "x", 10_000)], 1, num_requests=1)

    with serve_fake() as (endpoint, _):
        phase = run(measure())
    assert phase.records[0].status == 400 and "max_tokens" in (phase.records[0].error or "")
