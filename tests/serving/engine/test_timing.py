"""interleaved_medians: how the engine's start-up choices time their alternatives."""

from __future__ import annotations

import pytest

from serving.engine import timing
from serving.engine.timing import interleaved_medians


def test_variants_alternate_round_by_round_and_each_gets_its_median() -> None:
    calls: list[str] = []
    a_times, b_times = iter([5.0, 1.0, 3.0]), iter([2.0, 9.0, 4.0])

    def a() -> float:
        calls.append("a")
        return next(a_times)

    def b() -> float:
        calls.append("b")
        return next(b_times)

    assert interleaved_medians([a, b], rounds=3) == [3.0, 4.0]
    assert calls == ["a", "b"] * 3


def test_a_budget_stops_starting_rounds_once_the_minimum_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(float(t) for t in range(100))  # each perf_counter call: one second later
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    rounds: list[int] = []
    medians = interleaved_medians([lambda: float(len(rounds)), lambda: rounds.append(1) or 0.0], rounds=7,
                                  min_rounds=3, budget_s=0.5)
    assert len(rounds) == 3  # over budget after the first round, but three rounds are the minimum
    assert medians == [1.0, 0.0]
    assert len(interleaved_medians([lambda: 1.0], rounds=7)) == 1  # no budget: all seven rounds, one median
