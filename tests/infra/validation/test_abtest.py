from __future__ import annotations

from typing import Any

import pytest

from infra.validation.abtest import DISABLE, ENABLE, ABResult, ArmResult, DecisionRule, decide, run_ab
from infra.validation.loadgen import LoadGenerator, Phase, RequestRecord, Workload, run


def _arm(p99s: list[float], tokens_per_s: list[float], errors: int = 0) -> ArmResult:
    """One phase per repeat: 10 requests, the slowest at the given P99-ish latency."""
    arm = ArmResult()
    for p99, tput in zip(p99s, tokens_per_s, strict=True):
        records = [RequestRecord("code", 0, 200, ttft_s=0.1, e2e_s=p99 * 0.5, output_tokens=10) for _ in range(9)]
        records.append(RequestRecord("code", 0, 200, ttft_s=0.1, e2e_s=p99, output_tokens=10))
        records += [RequestRecord("code", 0, 500, error="boom") for _ in range(errors)]
        arm.phases.append(Phase("p", "closed", 1, None, 0, 100 / tput, records))
    return arm


def test_clear_latency_drop_with_steady_throughput_enables() -> None:
    d = decide("code", 1, on=_arm([1.0, 1.1, 1.0, 1.2], [100] * 4), off=_arm([2.0, 2.1, 1.9, 2.2], [100] * 4))
    assert d.verdict == ENABLE and d.separated and d.p99_gain > 0.4 and d.p_value == 1 / 70


def test_small_latency_drop_disables() -> None:
    d = decide("writing", 1, on=_arm([1.95] * 4, [100] * 4), off=_arm([2.0] * 4, [100] * 4))
    assert d.verdict == DISABLE and "less than the 10%" in d.reason


def test_slower_speculation_says_so() -> None:
    d = decide("writing", 1, on=_arm([3.0] * 4, [100] * 4), off=_arm([2.0] * 4, [100] * 4))
    assert d.verdict == DISABLE and "worse" in d.reason and "(+50%" in d.reason


def test_gain_within_run_to_run_noise_disables() -> None:
    # pooled P99 drops 30 %, but the repeats interleave: identical servers on a busy machine do this
    d = decide("code", 4, on=_arm([1.2, 2.1, 0.9, 2.0], [100] * 4), off=_arm([2.0, 3.0, 1.0, 1.5], [100] * 4))
    assert d.verdict == DISABLE and not d.separated and "noise" in d.reason


def test_noticeable_throughput_loss_disables_despite_lower_latency() -> None:
    d = decide("code", 16, on=_arm([1.0, 1.1, 1.0, 1.1], [80] * 4), off=_arm([2.0, 2.1, 2.0, 2.1], [100] * 4))
    assert d.verdict == DISABLE and d.throughput_change < -0.05 and "throughput falls" in d.reason


def test_small_throughput_loss_is_tolerated() -> None:
    d = decide("code", 1, on=_arm([1.0, 1.1, 1.0, 1.1], [97] * 4), off=_arm([2.0, 2.1, 2.0, 2.1], [100] * 4))
    assert d.verdict == ENABLE


def test_two_repeats_can_never_show_a_clear_drop() -> None:
    d = decide("code", 1, on=_arm([1.0, 1.0], [100, 100]), off=_arm([2.0, 2.0], [100, 100]))
    assert d.verdict == DISABLE and d.p_value == pytest.approx(1 / 6)


def test_errors_in_either_arm_disable() -> None:
    d = decide("code", 1, on=_arm([1.0], [100], errors=1), off=_arm([2.0], [100]))
    assert d.verdict == DISABLE and "errors" in d.reason


def test_thresholds_come_from_the_rule() -> None:
    on, off = _arm([1.7, 1.71, 1.72, 1.73], [100] * 4), _arm([2.0, 2.01, 2.02, 2.03], [100] * 4)
    assert decide("code", 1, on, off).verdict == ENABLE
    assert decide("code", 1, on, off, DecisionRule(min_p99_gain=0.2)).verdict == DISABLE


def test_recommendation_follows_the_level_nearest_the_target() -> None:
    win = (_arm([1.0, 1.1, 1.0, 1.1], [100] * 4), _arm([2.0, 2.1, 2.0, 2.1], [100] * 4))
    lose = (_arm([2.0] * 4, [90] * 4), _arm([2.0] * 4, [100] * 4))
    result = ABResult(DecisionRule(), {("code", 1): win, ("writing", 1): win, ("code", 16): lose,
                                       ("writing", 16): lose})
    low, high = result.recommendation(1), result.recommendation(12)
    assert low["enabled"] and low["concurrency"] == 1
    assert not high["enabled"] and high["concurrency"] == 16 and "concurrency 1" in high["reason"]


def test_arms_alternate_in_abba_order_and_send_identical_requests(serve_fake: Any) -> None:
    order: list[str] = []

    async def measure() -> ABResult:
        async with LoadGenerator(on_url, progress=False) as on, LoadGenerator(off_url, progress=False) as off:
            return await run_ab(on, off, {"code": [Workload("code", "x", 4)]}, [1], repeats=2,
                                requests_per_worker=2, on_phase=lambda p: order.append(p.labels["spec"]))

    with serve_fake() as (on_url, _), serve_fake() as (off_url, _):
        result = run(measure())
    assert order == ["on", "off", "off", "on"]
    on, off = result.cells[("code", 1)]
    assert [len(p.records) for p in on.phases] == [4, 4] and [len(p.records) for p in off.phases] == [4, 4]
    assert result.to_json()["cells"][0]["decision"]["verdict"] in (ENABLE, DISABLE)
    # the on arm's counters are read around its phases only: the off arm's server is never asked
    assert on.draft_tokens == 8 * 8 and on.accepted_tokens == 6 * 8 and off.draft_tokens == 0
    assert on.vetoed_share() == pytest.approx(0.8) and off.vetoed_share() is None
    cell = result.to_json()["cells"][0]
    assert cell["on"]["guard_vetoed_share"] == pytest.approx(0.8) and cell["off"]["guard_vetoed_share"] is None
    assert "ran 80% of the on arm's decoding steps without drafts" in cell["decision"]["reason"]


def test_a_mostly_vetoed_on_arm_is_named_in_the_reason_and_a_drafting_one_is_not() -> None:
    on, off = _arm([2.0] * 4, [100] * 4), _arm([2.0] * 4, [100] * 4)
    on.guard_cycles, on.guard_vetoed_cycles = 1000, 940
    d = decide("code", 64, on, off)
    assert d.verdict == DISABLE and "guard ran 94% of the on arm's decoding steps without drafts" in d.reason
    on.guard_vetoed_cycles = 300
    assert "guard" not in decide("code", 64, on, off).reason
