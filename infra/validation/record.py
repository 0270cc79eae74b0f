"""What one validation run measured and concluded: filled by the launch suite, read by the report."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from infra.validation.abtest import ABResult
from infra.validation.loadgen import Phase, SloTargets
from infra.validation.stats import linear_fit

GROUPS = ("functional", "host", "observability", "performance", "speculative", "stability")
REPORT_JSON = "report.json"
REPORT_MD = "summary.md"
REPORT_HTML = "report.html"


@dataclass(frozen=True)
class CheckOutcome:
    nodeid: str  # pytest node id
    group: str  # one of GROUPS (the test module's name)
    outcome: str  # passed, failed, skipped
    message: str  # failure summary or skip reason; empty when passed
    duration_s: float


@dataclass
class LaunchRun:
    stack: str
    endpoint: str
    profile: str
    slo: dict[str, Any]  # the stack's SloSpec as data
    targets: SloTargets | None = None
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    sweep: list[Phase] = field(default_factory=list)
    open_loop: Phase | None = None
    sustained: Phase | None = None
    ab: ABResult | None = None
    recommendation: dict[str, Any] | None = None
    target_concurrency: int = 1
    warmup_fraction: float = 0.2
    checks: list[CheckOutcome] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # facts worth a line in the report (how the A/B ran, ...)
    server: str = ""  # how the server ran: "container (image ..., podman)", "local process ...", "platform aws"
    hosts: list[str] = field(default_factory=list)  # testinfra backends the host checks ran on

    @property
    def passed(self) -> bool:
        ran = [c for c in self.checks if c.outcome != "skipped"]
        return bool(ran) and all(c.outcome == "passed" for c in ran)

    def counts(self) -> dict[str, int]:
        out = {"passed": 0, "failed": 0, "skipped": 0}
        for check in self.checks:
            out[check.outcome] = out.get(check.outcome, 0) + 1
        return out

    def memory_trend(self) -> dict[str, float] | None:
        """Linear fit of RSS (MiB) over minutes during the sustained run, warm-up left out."""
        if self.sustained is None:
            return None
        return memory_trend(self.sustained, self.warmup_fraction)

    def to_json(self) -> dict[str, Any]:
        return {
            "stack": self.stack,
            "endpoint": self.endpoint,
            "profile": self.profile,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "passed": self.passed,
            "counts": self.counts(),
            "slo": self.slo,
            "target_concurrency": self.target_concurrency,
            "checks": [c.__dict__ for c in self.checks],
            "sweep": [p.to_json(self.targets) for p in self.sweep],
            "open_loop": self.open_loop.to_json(self.targets) if self.open_loop else None,
            "sustained": self.sustained.to_json(self.targets) if self.sustained else None,
            "memory_trend": self.memory_trend(),
            "speculative_ab": self.ab.to_json(self.targets) if self.ab else None,
            "speculative_recommendation": self.recommendation,
            "notes": self.notes,
            "server": self.server,
            "hosts": self.hosts,
        }


def memory_trend(phase: Phase, warmup_fraction: float = 0.2) -> dict[str, float] | None:
    points = [(p.t_s, p.rss_bytes) for p in phase.samples if p.rss_bytes is not None]
    if len(points) < 3:
        return None
    skip = int(len(points) * warmup_fraction)
    points = points[skip:] if len(points) - skip >= 3 else points
    minutes = [t / 60 for t, _ in points]
    mib = [float(rss) / 2**20 for _, rss in points]
    slope, intercept = linear_fit(minutes, mib)
    return {"slope_mib_per_min": slope, "intercept_mib": intercept, "points": float(len(points)),
            "from_s": points[0][0], "to_s": points[-1][0], "growth_mib": slope * (minutes[-1] - minutes[0])}


# Growth of the fitted line over the whole window below which no slope counts as a leak: allocator
# arenas and caches grow in steps of a few MiB as batch shapes vary, and over a short (quick-profile)
# window one such step reads as tens of MiB per minute. Over the standard profile's 15 minutes any
# slope above the SLO grows far more than this.
MEMORY_NOISE_FLOOR_MIB = 16.0


def memory_leak_suspected(trend: dict[str, float], limit_mib_per_min: float) -> bool:
    """The stability verdict: the fitted slope exceeds the SLO *and* the fitted growth exceeds the floor."""
    return trend["slope_mib_per_min"] > limit_mib_per_min and trend["growth_mib"] > MEMORY_NOISE_FLOOR_MIB


@dataclass(frozen=True)
class SloFigure:
    name: str  # e.g. "P99 TTFT"
    unit: str
    target: float
    measured: float | None  # None: nothing measured (counts as a failure)
    higher_is_better: bool = False

    @property
    def passed(self) -> bool:
        if self.measured is None:
            return False
        return self.measured >= self.target if self.higher_is_better else self.measured <= self.target

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "unit": self.unit, "target": self.target, "measured": self.measured,
                "higher_is_better": self.higher_is_better, "passed": self.passed}


def slo_figures(summary: dict[str, Any], slo: dict[str, Any]) -> list[SloFigure]:
    """The stack's SLOs next to what a phase measured (``Phase.summary()``), one figure each."""

    def ms(key: str) -> float | None:
        value = summary[key]["p99"]
        return None if value is None else value * 1000

    return [
        SloFigure("P99 TTFT", "ms", slo["ttft_p99_ms"], ms("ttft_s")),
        SloFigure("P99 TPOT", "ms", slo["tpot_p99_ms"], ms("tpot_s")),
        SloFigure("P99 E2E", "s", slo["e2e_p99_s"], summary["e2e_s"]["p99"]),
        SloFigure("token throughput", "tokens/s", slo["min_tokens_per_s"], summary["token_throughput_tps"],
                  higher_is_better=True),
        SloFigure("error rate", "", slo["max_error_rate"], summary["error_rate"]),
    ]
