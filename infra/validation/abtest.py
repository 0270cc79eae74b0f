"""Speculative decoding A/B: same host, same parameters, speculation on vs off, and the decision.

The guide's rule (guide-deploy-and-speculative-decoding, 七.3): with everything else unchanged,
speculation is a net gain only if single-request P99 latency drops *clearly* and throughput does
*not drop noticeably*; otherwise it stays off. Made concrete here (``DecisionRule``):

- "clearly": pooled P99 E2E falls by at least ``min_p99_gain`` (10 %) *and* the per-repeat P99s
  of the speculative arm rank below the plain arm's with an exact one-sided Mann-Whitney p-value of
  at most ``max_p_value`` (5 %), so the gain is not run-to-run noise (with 6 repeats: up to 7 of the 36
  pairs out of order; a shared machine's noise easily produces a 10 % "gain" between identical servers);
- "not noticeably": output-token throughput falls by at most ``max_throughput_loss`` (5 %).

The decision is made per cell (prompt set x concurrency level), because speculation pays off on
predictable text at low load and gets in the way of batching at high load. Phases alternate
on/off in ABBA order over the repeats, so slow drift on a shared machine hits both arms alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from infra.validation import prom
from infra.validation.loadgen import LoadGenerator, Phase, SloTargets, Workload
from infra.validation.stats import percentile, rank_test_p, spread
from serving import metric_names as names

ENABLE = "enable"
DISABLE = "disable"


@dataclass(frozen=True)
class DecisionRule:
    min_p99_gain: float = 0.10  # P99 E2E must fall by at least this share ("明显下降")
    max_throughput_loss: float = 0.05  # token throughput may fall by at most this share ("不明显下降")
    max_p_value: float = 0.05  # rank test of the repeats: how unlikely the ordering must be under no effect


@dataclass
class ArmResult:
    """One arm (on or off) of one cell: its repeated phases."""

    phases: list[Phase] = field(default_factory=list)
    accepted_tokens: float = 0.0  # draft tokens accepted during the arm's phases (on arm only)
    draft_tokens: float = 0.0  # draft tokens proposed during the arm's phases
    guard_cycles: float = 0.0  # decoding steps the speculation guard decided during the arm's phases
    guard_vetoed_cycles: float = 0.0  # of which run without drafts: drafting measured slower at that load

    def vetoed_share(self) -> float | None:
        """Share of the guard's steps run without drafts by a veto; None where no guard decided any."""
        return self.guard_vetoed_cycles / self.guard_cycles if self.guard_cycles else None

    def e2e(self) -> list[float]:
        return [r.e2e_s for p in self.phases for r in p.ok_records if r.e2e_s is not None]

    def p99_e2e(self) -> float | None:
        return percentile(self.e2e(), 99)

    def repeat_p99s(self) -> list[float]:
        values = [percentile([r.e2e_s for r in p.ok_records if r.e2e_s is not None], 99) for p in self.phases]
        return [v for v in values if v is not None]

    def repeat_throughputs(self) -> list[float]:
        return [sum(r.output_tokens for r in p.ok_records) / max(p.duration_s, 1e-9) for p in self.phases]

    def throughput(self) -> float:
        tokens = sum(r.output_tokens for p in self.phases for r in p.ok_records)
        seconds = sum(p.duration_s for p in self.phases)
        return tokens / seconds if seconds > 0 else 0.0

    def errors(self) -> int:
        return sum(len(p.records) - len(p.ok_records) for p in self.phases)

    def tpot_p99(self) -> float | None:
        return percentile([t for p in self.phases for r in p.ok_records if (t := r.tpot_s) is not None], 99)

    def ttft_p99(self) -> float | None:
        return percentile([r.ttft_s for p in self.phases for r in p.ok_records if r.ttft_s is not None], 99)


@dataclass(frozen=True)
class Decision:
    prompt_set: str
    concurrency: int
    verdict: str  # ENABLE or DISABLE
    p99_gain: float | None  # relative drop of pooled P99 E2E (positive = speculation faster)
    throughput_change: float | None  # relative change of token throughput (negative = loss)
    separated: bool  # the repeats' ordering is unlikely under "no effect" (rank test p <= max_p_value)
    p_value: float | None  # exact one-sided Mann-Whitney p of the per-repeat P99s
    reason: str  # one sentence a reader can check against the numbers

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def decide(prompt_set: str, concurrency: int, on: ArmResult, off: ArmResult,
           rule: DecisionRule = DecisionRule()) -> Decision:
    """Apply the guide's rule to one cell."""
    p99_on, p99_off = on.p99_e2e(), off.p99_e2e()
    tput_on, tput_off = on.throughput(), off.throughput()
    if on.errors() or off.errors():
        return Decision(prompt_set, concurrency, DISABLE, None, None, False, None,
                        f"errors during the A/B (on: {on.errors()}, off: {off.errors()}); no comparison")
    if p99_on is None or p99_off is None or p99_off <= 0 or tput_off <= 0:
        return Decision(prompt_set, concurrency, DISABLE, None, None, False, None, "no completed requests to compare")
    gain = 1 - p99_on / p99_off
    change = tput_on / tput_off - 1
    p_value = rank_test_p(on.repeat_p99s(), off.repeat_p99s())
    separated = p_value <= rule.max_p_value
    numbers = (f"P99 E2E off {p99_off:.2f}s, on {p99_on:.2f}s ({-gain:+.0%}, rank test p={p_value:.2f}), "
               f"tokens/s {change:+.0%}")
    if gain < 0:
        reason, verdict = f"{numbers}: speculation makes P99 worse", DISABLE
    elif gain < rule.min_p99_gain:
        reason, verdict = f"{numbers}: P99 drops less than the {rule.min_p99_gain:.0%} a clear gain needs", DISABLE
    elif not separated:
        reason, verdict = f"{numbers}: the drop is within run-to-run noise (the repeats overlap)", DISABLE
    elif change < -rule.max_throughput_loss:
        reason, verdict = f"{numbers}: throughput falls more than {rule.max_throughput_loss:.0%}", DISABLE
    else:
        reason, verdict = f"{numbers}: P99 drops clearly and throughput holds", ENABLE
    vetoed = on.vetoed_share()
    if vetoed is not None and vetoed >= 0.5:  # why the arms read alike: the on arm mostly ran plain
        reason += (f"; the speculation guard ran {vetoed:.0%} of the on arm's decoding steps without drafts "
                   "(drafting measured slower at this load)")
    return Decision(prompt_set, concurrency, verdict, gain, change, separated, p_value, reason)


@dataclass
class ABResult:
    rule: DecisionRule
    cells: dict[tuple[str, int], tuple[ArmResult, ArmResult]]  # (prompt set, concurrency) -> (on, off)
    method: str = ""  # how the two arms were produced (runtime switch or two servers), for the report

    def decisions(self) -> list[Decision]:
        return [decide(ps, c, on, off, self.rule) for (ps, c), (on, off) in sorted(self.cells.items())]

    def recommendation(self, target_concurrency: int) -> dict[str, Any]:
        """Recommended ``speculative.enabled`` for the stack: the verdict at the tested level closest
        to the stack's target concurrency, by majority over prompt sets (ties stay off)."""
        decisions = self.decisions()
        if not decisions:
            return {"enabled": False, "reason": "no A/B cells were measured"}
        levels = sorted({d.concurrency for d in decisions})
        level = min(levels, key=lambda c: (abs(c - target_concurrency), -c))
        at_level = [d for d in decisions if d.concurrency == level]
        enabled_sets = [d.prompt_set for d in at_level if d.verdict == ENABLE]
        enabled = len(enabled_sets) * 2 > len(at_level)
        low = min(levels)
        low_wins = [d.prompt_set for d in decisions if d.concurrency == low and d.verdict == ENABLE]
        reason = (f"at concurrency {level}, the tested level closest to the SLO target {target_concurrency}, "
                  f"speculation passes the rule for {len(enabled_sets)} of {len(at_level)} prompt sets: "
                  f"{', '.join(enabled_sets) or 'none'}")
        if not enabled and low_wins and low != level:
            reason += f"; it would pay off at concurrency {low} for {', '.join(low_wins)}"
        return {"enabled": enabled, "concurrency": level, "enabled_prompt_sets": enabled_sets, "reason": reason}

    def to_json(self, slo: SloTargets | None = None) -> dict[str, Any]:
        cells = []
        for (ps, c), (on, off) in sorted(self.cells.items()):
            cells.append({
                "prompt_set": ps,
                "concurrency": c,
                "on": _arm_json(on, slo),
                "off": _arm_json(off, slo),
                "decision": decide(ps, c, on, off, self.rule).as_dict(),
            })
        return {"rule": self.rule.__dict__, "method": self.method, "cells": cells}


def _arm_json(arm: ArmResult, slo: SloTargets | None) -> dict[str, Any]:
    repeats = arm.repeat_p99s()
    tputs = arm.repeat_throughputs()
    return {
        "p99_e2e_s": arm.p99_e2e(),
        "p99_e2e_repeats_s": repeats,
        "p99_e2e_spread_s": spread(repeats),
        "p99_ttft_s": arm.ttft_p99(),
        "p99_tpot_s": arm.tpot_p99(),
        "token_throughput_tps": arm.throughput(),
        "token_throughput_repeats_tps": tputs,
        "token_throughput_spread_tps": spread(tputs),
        "requests": sum(len(p.records) for p in arm.phases),
        "errors": arm.errors(),
        "acceptance_rate": arm.accepted_tokens / arm.draft_tokens if arm.draft_tokens else None,
        "guard_vetoed_share": arm.vetoed_share(),
        "phases": [p.summary(slo) for p in arm.phases],
    }


_SPEC_COUNTERS = (names.SPEC_ACCEPTED_TOKENS, names.SPEC_DRAFT_TOKENS, names.SPEC_GUARD_CYCLES,
                  names.SPEC_GUARD_VETOED_CYCLES)


async def _spec_counters(gen: LoadGenerator) -> list[float]:
    """The on arm's accepted and drafted tokens, and its guard's steps and vetoed steps, as /metrics has them."""
    from infra.validation.loadgen import scrape

    samples = await scrape(gen.client, gen.api_key)
    return [prom.value(samples, f"{name}_total") or 0.0 for name in _SPEC_COUNTERS]


async def run_ab(on: LoadGenerator, off: LoadGenerator, workloads: Mapping[str, Sequence[Workload]],
                 concurrencies: Sequence[int], repeats: int, requests_per_worker: int, min_requests: int = 4,
                 rule: DecisionRule = DecisionRule(), method: str = "",
                 on_phase: Callable[[Phase], None] | None = None) -> ABResult:
    """Alternate on/off phases (ABBA over repeats) for every prompt set and concurrency level.

    Each phase is a closed loop sending the same requests, in the same order, to one arm: greedy
    decoding makes both arms produce the same tokens, so they do exactly the same work.
    """
    cells: dict[tuple[str, int], tuple[ArmResult, ArmResult]] = {
        (ps, c): (ArmResult(), ArmResult()) for ps in workloads for c in concurrencies
    }
    for repeat in range(repeats):
        for cell_index, (prompt_set, concurrency) in enumerate(cells):
            items = workloads[prompt_set]
            arms = cells[(prompt_set, concurrency)]
            order = ((on, arms[0], "on"), (off, arms[1], "off"))
            if (repeat + cell_index) % 2:  # each cell flips its order every repeat: ABBA
                order = order[::-1]
            count = max(min_requests, concurrency * requests_per_worker)
            for gen, arm, label in order:
                before = await _spec_counters(gen) if label == "on" else []
                phase = await gen.closed_loop(
                    f"A/B {prompt_set} c={concurrency} spec {label} #{repeat + 1}", items, concurrency,
                    num_requests=count,
                    labels={"spec": label, "prompt_set": prompt_set, "repeat": str(repeat + 1)})
                if label == "on":
                    after = await _spec_counters(gen)
                    accepted, drafted, cycles, vetoed = (b - a for a, b in zip(before, after, strict=True))
                    arm.accepted_tokens += accepted
                    arm.draft_tokens += drafted
                    arm.guard_cycles += cycles
                    arm.guard_vetoed_cycles += vetoed
                arm.phases.append(phase)
                if on_phase is not None:
                    on_phase(phase)
    return ABResult(rule=rule, cells=cells, method=method)
