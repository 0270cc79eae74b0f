"""The arithmetic of a benchmark: percentiles, the TPOT formula, linear trends, error clustering.

Percentiles come from serving.stats (linear interpolation, shared with the engine benchmarks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

from serving.stats import percentile


@dataclass(frozen=True)
class Distribution:
    n: int  # sample size
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    def as_dict(self) -> dict[str, float | int | None]:
        return {"n": self.n, "mean": self.mean, "p50": self.p50, "p90": self.p90, "p99": self.p99, "max": self.max}


def distribution(values: Sequence[float]) -> Distribution:
    if not values:
        return Distribution(0, None, None, None, None, None)
    return Distribution(
        n=len(values),
        mean=sum(values) / len(values),
        p50=percentile(values, 50),
        p90=percentile(values, 90),
        p99=percentile(values, 99),
        max=max(values),
    )


def tpot(e2e_s: float, ttft_s: float, output_tokens: int) -> float | None:
    """Time per output token after the first: (E2E - TTFT) / (output tokens - 1), vLLM's definition.

    Undefined (None) for fewer than two output tokens: there is no decode interval to average.
    """
    if output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares slope and intercept of y over x; slope 0 when x does not vary."""
    if len(xs) != len(ys):
        raise ValueError("linear_fit: xs and ys differ in length")
    if len(xs) < 2:
        return 0.0, ys[0] if ys else 0.0
    mean_x = sum(xs) / len(xs)
    mean_y = sum(ys) / len(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, mean_y
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    return slope, mean_y - slope * mean_x


def spread(values: Sequence[float]) -> tuple[float, float, float] | None:
    """(mean, min, max) of repeated measurements; None when there are none."""
    if not values:
        return None
    return sum(values) / len(values), min(values), max(values)


@dataclass(frozen=True)
class Clustering:
    errors: int  # errors in the window
    busiest_share: float  # share of the errors inside the busiest bin
    clustered: bool


def error_clustering(error_times: Sequence[float], start: float, end: float, bins: int = 10,
                     min_errors: int = 5, max_share: float = 0.5) -> Clustering:
    """Are errors bunched in time? Split [start, end] into ``bins`` equal bins; errors are clustered
    when there are at least ``min_errors`` of them and one bin (a tenth of the run by default) holds
    more than ``max_share`` of them. Spread-out errors point at a rate problem, bunched ones at an
    incident (a stall, a restart, a leak reaching its limit); both matter, but differently."""
    n = len(error_times)
    if n == 0 or end <= start:
        return Clustering(n, 0.0, False)
    width = (end - start) / bins
    counts = [0] * bins
    for t in error_times:
        index = min(bins - 1, max(0, int((t - start) / width)))
        counts[index] += 1
    share = max(counts) / n
    return Clustering(n, share, n >= min_errors and share > max_share)


def rank_test_p(smaller: Sequence[float], larger: Sequence[float]) -> float:
    """One-sided exact Mann-Whitney p-value for "``smaller`` tends to be below ``larger``".

    Enumerates every way to split the pooled values into groups of the two sizes (fine for the
    handful of repeats an A/B has): the p-value is the share of splits whose U statistic is at most
    the observed one. With 4 repeats per arm a perfect separation has p = 1/70, one swapped pair
    4/70; with 2 repeats no outcome gets below 1/6, so two repeats can never show a clear drop.
    """
    n, m = len(smaller), len(larger)
    if n == 0 or m == 0:
        return 1.0

    def u_statistic(a: Sequence[float], b: Sequence[float]) -> float:
        # pairs where a is not below b (ties count half): small U = a tends to be smaller
        return sum(1.0 if x > y else 0.5 if x == y else 0.0 for x in a for y in b)

    observed = u_statistic(smaller, larger)
    pooled = list(smaller) + list(larger)
    indices = range(n + m)
    total = at_most = 0
    for chosen in combinations(indices, n):
        picked = set(chosen)
        a = [pooled[i] for i in chosen]
        b = [pooled[i] for i in indices if i not in picked]
        total += 1
        at_most += u_statistic(a, b) <= observed + 1e-12
    return at_most / total
