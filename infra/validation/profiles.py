"""How long and how hard each validation profile pushes a deployment.

- quick: minutes; CI's launch verdict and `make demo` (a 2-core CPU with the demo model must finish it in
  about three minutes). Too short to prove stability; it proves the machinery and catches gross faults.
- standard: the guide's launch bar: a concurrency sweep and >= 15 minutes of sustained load
  (guide-planning-launch-operations, 八.2), an A/B over all four prompt sets with six repeats.

A/B levels always include the SLO's target concurrency (the recommendation is made there).
- soak: the same, sustained for hours (guide-deploy-and-speculative-decoding, 七.4: 不低于数小时).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    name: str
    max_tokens: int  # cap on each request's output budget
    sweep_concurrency: tuple[int, ...]  # closed-loop levels of the sweep (clipped to max_concurrency)
    sweep_requests_per_worker: int  # requests per worker at each level
    sweep_min_requests: int  # per level, also at concurrency 1
    open_loop_s: float  # Poisson phase at 80 % of the measured capacity at target concurrency
    sustained_s: float  # closed loop at target concurrency: sustained SLO figures and stability
    ab_prompt_sets: tuple[str, ...]
    ab_concurrency: tuple[int, ...]  # low and high load (clipped to max_concurrency)
    ab_repeats: int  # on/off pairs per cell: more short repeats beat fewer long ones for the rank test
    ab_requests_per_worker: int
    ab_min_requests: int  # per phase, also at concurrency 1
    sample_interval_s: float  # /metrics polling during load
    warmup_fraction: float = 0.2  # share of the sustained run left out of the memory trend

    def levels(self, values: tuple[int, ...], max_concurrency: int, target: int) -> tuple[int, ...]:
        """The profile's levels within the server's limit, always including the SLO target."""
        return tuple(sorted({min(v, max_concurrency) for v in values} | {min(target, max_concurrency)}))


PROFILES: dict[str, Profile] = {
    "quick": Profile(
        name="quick", max_tokens=32, sweep_concurrency=(1, 4), sweep_requests_per_worker=2, sweep_min_requests=4,
        open_loop_s=10, sustained_s=30, ab_prompt_sets=("code", "writing"), ab_concurrency=(1, 4),
        ab_repeats=6, ab_requests_per_worker=1, ab_min_requests=2, sample_interval_s=1.0,
    ),
    "standard": Profile(
        name="standard", max_tokens=128, sweep_concurrency=(1, 2, 4, 8, 16, 32), sweep_requests_per_worker=4,
        sweep_min_requests=16,
        open_loop_s=120, sustained_s=15 * 60, ab_prompt_sets=("code", "chat", "extraction", "writing"),
        ab_concurrency=(1, 4, 16), ab_repeats=6, ab_requests_per_worker=4, ab_min_requests=8, sample_interval_s=2.0,
    ),
    "soak": Profile(
        name="soak", max_tokens=128, sweep_concurrency=(1, 4, 16), sweep_requests_per_worker=4, sweep_min_requests=16,
        open_loop_s=300, sustained_s=4 * 3600, ab_prompt_sets=("code", "chat", "extraction", "writing"),
        ab_concurrency=(1, 4, 16), ab_repeats=6, ab_requests_per_worker=4, ab_min_requests=8, sample_interval_s=10.0,
        warmup_fraction=0.05,
    ),
}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose one of {', '.join(PROFILES)}") from None
