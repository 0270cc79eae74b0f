from __future__ import annotations

from infra.validation.loadgen import MetricsPoint, Phase
from infra.validation.record import memory_leak_suspected, memory_trend


def _phase(rss_mib: list[float], every_s: float = 1.0) -> Phase:
    samples = [MetricsPoint(i * every_s, mib * 2**20, None, 0.0, 4.0, 10.0) for i, mib in enumerate(rss_mib)]
    return Phase("sustained", "closed", 4, None, 0.0, len(rss_mib) * every_s, [], samples)


def test_trend_leaves_the_warm_up_out() -> None:
    trend = memory_trend(_phase([500.0] * 6 + [750.0] * 24), warmup_fraction=0.2)
    assert trend is not None and trend["slope_mib_per_min"] == 0.0 and trend["from_s"] == 6.0


def test_a_steady_leak_is_suspected_even_in_a_short_run() -> None:
    trend = memory_trend(_phase([700 + 2.0 * i for i in range(30)]))  # 120 MiB/min for 30 s
    assert trend is not None and memory_leak_suspected(trend, 20.0)


def test_one_allocator_step_in_a_short_run_is_not_a_leak() -> None:
    # the quick profile's demo run: +1.8 MiB at 16 s, +6 MiB at 23 s -> a fitted 25 MiB/min, 10 MiB in all
    rss = [750.5] * 16 + [752.3] * 7 + [758.5] * 7
    trend = memory_trend(_phase(rss))
    assert trend is not None and trend["slope_mib_per_min"] > 20.0
    assert not memory_leak_suspected(trend, 20.0)


def test_a_slow_leak_over_the_standard_run_is_suspected() -> None:
    trend = memory_trend(_phase([700 + 0.5 * i for i in range(90)], every_s=10.0))  # 3 MiB/min for 15 min
    assert trend is not None and memory_leak_suspected(trend, 2.0) and not memory_leak_suspected(trend, 5.0)
