"""The load a profile prescribes, phase by phase: sweep, Poisson load, sustained run, speculative A/B.

Synchronous entry points for the launch suite's session fixtures (each runs its own event loop).
"""

from __future__ import annotations

import httpx

from infra.validation import prom
from infra.validation.abtest import ABResult, run_ab
from infra.validation.loadgen import LoadGenerator, Phase, Workload, auth_headers, load_workloads, run
from infra.validation.profiles import Profile
from serving import metric_names

OPEN_LOOP_LOAD = 0.8  # Poisson rate as a share of the request rate measured at target concurrency
MIN_ARRIVALS = 8  # expected requests of the Poisson phase


def _generator(endpoint: str, api_key: str | None, profile: Profile) -> LoadGenerator:
    return LoadGenerator(endpoint, api_key, sample_interval_s=profile.sample_interval_s)


def sweep(endpoint: str, api_key: str | None, profile: Profile, levels: tuple[int, ...],
          workloads: list[Workload]) -> dict[int, Phase]:
    """Closed-loop phases at each concurrency level, all prompt sets mixed, after a short warm-up."""

    async def measure() -> dict[int, Phase]:
        phases = {}
        async with _generator(endpoint, api_key, profile) as gen:
            await gen.closed_loop("warm-up", workloads, 1, num_requests=2)
            for level in levels:
                count = max(profile.sweep_min_requests, level * profile.sweep_requests_per_worker)
                phases[level] = await gen.closed_loop(f"sweep c={level}", workloads, level, num_requests=count)
        return phases

    result: dict[int, Phase] = run(measure())
    return result


def open_loop(endpoint: str, api_key: str | None, profile: Profile, capacity_rps: float,
              workloads: list[Workload]) -> Phase:
    """Poisson arrivals below the measured capacity: queueing shows up as TTFT, not as a slower client."""
    rate = max(0.05, OPEN_LOOP_LOAD * capacity_rps)
    # A slow deployment gets longer, up to three times the profile's duration, to expect MIN_ARRIVALS requests.
    duration = max(profile.open_loop_s, min(MIN_ARRIVALS / rate, 3 * profile.open_loop_s))

    async def measure() -> Phase:
        async with _generator(endpoint, api_key, profile) as gen:
            return await gen.open_loop(f"open loop {rate:.2f} req/s", workloads, rate, duration)

    phase: Phase = run(measure())
    return phase


def sustained(endpoint: str, api_key: str | None, profile: Profile, concurrency: int,
              workloads: list[Workload]) -> Phase:
    """Closed loop at ``concurrency`` for the profile's sustained duration."""

    async def measure() -> Phase:
        async with _generator(endpoint, api_key, profile) as gen:
            return await gen.closed_loop(f"sustained c={concurrency} {profile.sustained_s / 60:.1f} min", workloads,
                                         concurrency, duration_s=profile.sustained_s)

    phase: Phase = run(measure())
    return phase


def is_speculating(endpoint: str, api_key: str | None) -> bool:
    """A server exports the speculation counters only when speculation is on."""
    text = httpx.get(f"{endpoint}/metrics", headers=auth_headers(api_key), timeout=30).text
    return f"{metric_names.SPEC_DRAFTS}_total" in prom.series_names(text)


def speculative_ab(on_url: str, off_url: str, api_key: str | None, profile: Profile, levels: tuple[int, ...],
                   method: str) -> ABResult:
    """The profile's A/B between a speculating and a plain server; both warmed before anything is timed."""
    by_set = {ps: load_workloads([ps], profile.max_tokens) for ps in profile.ab_prompt_sets}

    async def measure() -> ABResult:
        async with _generator(on_url, api_key, profile) as on, _generator(off_url, api_key, profile) as off:
            for gen in (on, off):
                await gen.closed_loop("A/B warm-up", by_set[profile.ab_prompt_sets[0]], 1, num_requests=2)
            return await run_ab(on, off, by_set, levels, profile.ab_repeats, profile.ab_requests_per_worker,
                                min_requests=profile.ab_min_requests, method=method)

    result: ABResult = run(measure())
    return result
