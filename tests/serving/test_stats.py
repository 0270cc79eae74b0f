"""percentile: linear interpolation between order statistics, numpy's default."""

from __future__ import annotations

import pytest

from serving.stats import percentile


def test_percentile_interpolates_linearly_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(7.6)  # numpy.percentile(values, 90)
    assert percentile(values, 99) == pytest.approx(9.76)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0


def test_percentile_of_one_value_is_that_value() -> None:
    assert percentile([0.25], 99) == 0.25


def test_percentile_of_nothing_is_none() -> None:
    assert percentile([], 50) is None


def test_percentile_rejects_q_outside_0_100() -> None:
    with pytest.raises(ValueError, match="q must lie"):
        percentile([1.0], 101)


def test_percentile_ignores_input_order() -> None:
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0
