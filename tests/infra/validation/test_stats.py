from __future__ import annotations

import pytest

from infra.validation.stats import distribution, error_clustering, linear_fit, rank_test_p, tpot


def test_distribution_of_nothing_has_no_percentiles() -> None:
    assert distribution([]).p99 is None


def test_distribution_percentiles_interpolate() -> None:
    summary = distribution([1.0, 2.0, 3.0, 4.0, 10.0])
    assert (summary.p50, summary.max) == (3.0, 10.0)
    assert summary.p90 == pytest.approx(7.6)


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    # 10 tokens, first after 0.5 s, last at 2.3 s: 9 decode intervals in 1.8 s
    assert tpot(2.3, 0.5, 10) == pytest.approx(0.2)


def test_tpot_is_undefined_below_two_tokens() -> None:
    assert tpot(1.0, 1.0, 1) is None
    assert tpot(1.0, 1.0, 0) is None


def test_linear_fit_recovers_slope_and_intercept() -> None:
    xs = [0.0, 1.0, 2.0, 3.0]
    slope, intercept = linear_fit(xs, [5 + 2 * x for x in xs])
    assert slope == pytest.approx(2.0) and intercept == pytest.approx(5.0)


def test_linear_fit_of_a_flat_series_is_zero() -> None:
    assert linear_fit([0.0, 1.0, 2.0], [7.0, 7.0, 7.0])[0] == 0.0


def test_errors_spread_over_the_run_are_not_clustered() -> None:
    times = [i * 10.0 + 1 for i in range(10)]
    assert not error_clustering(times, 0, 100).clustered


def test_errors_in_one_burst_are_clustered() -> None:
    result = error_clustering([50.0, 50.5, 51.0, 51.2, 52.0, 90.0], 0, 100)
    assert result.clustered and result.busiest_share == pytest.approx(5 / 6)


def test_a_few_errors_are_never_called_a_cluster() -> None:
    assert not error_clustering([50.0, 50.1], 0, 100).clustered


def test_rank_test_of_a_perfect_separation_is_one_over_the_number_of_splits() -> None:
    assert rank_test_p([1, 2, 3, 4], [5, 6, 7, 8]) == pytest.approx(1 / 70)  # C(8, 4) = 70


def test_rank_test_allows_one_swapped_pair_at_four_repeats() -> None:
    assert rank_test_p([1, 2, 3, 5], [4, 6, 7, 8]) == pytest.approx(2 / 70)
    assert rank_test_p([1, 2, 3, 5], [4, 6, 7, 8]) <= 0.05 < rank_test_p([1, 2, 4, 6], [3, 5, 7, 8])


def test_rank_test_of_the_wrong_direction_is_near_one() -> None:
    assert rank_test_p([5, 6, 7, 8], [1, 2, 3, 4]) == 1.0


def test_rank_test_counts_ties_half() -> None:
    assert rank_test_p([1, 1], [1, 1]) == 1.0
