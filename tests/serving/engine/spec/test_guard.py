"""The guard holds the adaptive policy's choices against the clock (serving.engine.spec.guard)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from serving.engine.config import SpeculativeConfig
from serving.engine.spec import guard as g
from serving.engine.spec.guard import SpeculationGuard, bucket
from serving.engine.types import GenerationRequest, SamplingParams


def run_cycles(guard: SpeculationGuard, cycles: int, decoding: int, drafting_tps: float,
               plain_tps: float) -> list[bool]:
    """`cycles` cycles at `decoding` sequences: each one drafting where the guard allows it, timed at the rate
    given for its kind (tokens fixed, seconds from the rate); returns what the guard allowed."""
    allowed = []
    for _ in range(cycles):
        drafts = guard.allows_drafting(decoding)
        allowed.append(drafts)
        tokens = 2 * decoding if drafts else decoding
        guard.observe(decoding, drafts, tokens, tokens / (drafting_tps if drafts else plain_tps))
    return allowed


def test_buckets_are_half_octaves_of_the_decoding_sequences() -> None:
    assert [bucket(n) for n in (1, 2, 3, 4, 6, 8, 16, 64)] == [0, 2, 3, 4, 5, 6, 8, 12]
    assert bucket(15) == bucket(16) == bucket(17)


def test_until_plain_cycles_are_measured_every_fourth_cycle_runs_plain() -> None:
    guard = SpeculationGuard()
    allowed = run_cycles(guard, 4 * g.MIN_SAMPLES, 16, drafting_tps=2000, plain_tps=1000)
    assert allowed.count(False) == g.MIN_SAMPLES and all(allowed[i] is False for i in range(3, len(allowed), 4))


def test_where_drafting_wins_it_stays_on_and_plain_cycles_are_rare() -> None:
    guard = SpeculationGuard()
    run_cycles(guard, 4 * g.MIN_SAMPLES, 1, drafting_tps=2500, plain_tps=1000)
    allowed = run_cycles(guard, 2 * g.REFRESH_FAR, 1, drafting_tps=2500, plain_tps=1000)
    assert allowed.count(False) <= 2 and not guard.buckets[bucket(1)].vetoed


def test_where_drafting_loses_the_bucket_is_vetoed_and_its_probes_back_off() -> None:
    """Vetoed, the bucket drafts only in probes of PROBE_CYCLES; each probe that leaves the veto on doubles the
    wait before the next, up to PROBE_EVERY_MAX."""
    guard = SpeculationGuard()
    run_cycles(guard, 8 * g.MIN_SAMPLES, 64, drafting_tps=1800, plain_tps=2000)
    assert guard.buckets[bucket(64)].vetoed and guard.vetoes_total == 1
    allowed = run_cycles(guard, 4 * g.PROBE_EVERY_MAX, 64, drafting_tps=1800, plain_tps=2000)
    starts = [i for i, a in enumerate(allowed) if a and (i == 0 or not allowed[i - 1])]
    assert all(allowed[i:i + g.PROBE_CYCLES] == [True] * g.PROBE_CYCLES for i in starts)
    assert allowed.count(True) == len(starts) * g.PROBE_CYCLES
    # plain cycles between two probes: the interval counts from a probe's last cycle, the next probe's first
    # cycle is the interval's last
    gaps = [b - a - g.PROBE_CYCLES + 1 for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps[:4] == [2 * g.PROBE_EVERY, 4 * g.PROBE_EVERY, 8 * g.PROBE_EVERY, g.PROBE_EVERY_MAX]
    assert set(gaps[3:]) == {g.PROBE_EVERY_MAX}
    assert guard.buckets[bucket(64)].vetoed and guard.vetoes_total == 1


def test_a_tie_turns_drafting_off_and_only_a_clear_lead_turns_it_back_on() -> None:
    """Drafting 1 % ahead of plain is a tie within the cycles' noise: vetoed. A probe 5 % ahead leaves the veto on;
    one 10 % ahead lifts it."""
    guard = SpeculationGuard()
    run_cycles(guard, 8 * g.MIN_SAMPLES, 16, drafting_tps=2020, plain_tps=2000)
    b = guard.buckets[bucket(16)]
    assert b.vetoed
    run_cycles(guard, 4 * g.PROBE_EVERY, 16, drafting_tps=2100, plain_tps=2000)
    assert b.vetoed
    run_cycles(guard, 2 * g.PROBE_EVERY_MAX, 16, drafting_tps=2200, plain_tps=2000)
    assert not b.vetoed


def test_a_lift_that_does_not_hold_backs_off_and_one_that_held_starts_afresh() -> None:
    """A veto soon after a lift (a probe read well by chance) doubles the probe interval; a veto after a lift
    that held for PROBE_EVERY_MAX cycles (the load changed) starts from PROBE_EVERY again."""
    guard = SpeculationGuard()
    run_cycles(guard, 8 * g.MIN_SAMPLES, 64, drafting_tps=1800, plain_tps=2000)
    b = guard.buckets[bucket(64)]
    assert b.vetoed and b.probe_every == g.PROBE_EVERY
    run_cycles(guard, 2 * g.PROBE_EVERY, 64, drafting_tps=3000, plain_tps=2000)  # a probe reads well: lifted
    assert not b.vetoed
    run_cycles(guard, 8 * g.MIN_SAMPLES, 64, drafting_tps=1500, plain_tps=2000)  # and vetoed again soon
    assert b.vetoed and b.probe_every == 2 * g.PROBE_EVERY
    run_cycles(guard, 4 * g.PROBE_EVERY, 64, drafting_tps=3000, plain_tps=2000)
    assert not b.vetoed
    run_cycles(guard, 2 * g.PROBE_EVERY_MAX, 64, drafting_tps=3000, plain_tps=2000)  # the lift holds
    run_cycles(guard, 8 * g.MIN_SAMPLES + g.REFRESH_NEAR, 64, drafting_tps=1500, plain_tps=2000)
    assert b.vetoed and b.probe_every == g.PROBE_EVERY


def test_a_veto_lifts_when_probes_measure_faster_and_buckets_are_independent() -> None:
    guard = SpeculationGuard()
    run_cycles(guard, 8 * g.MIN_SAMPLES, 64, drafting_tps=1800, plain_tps=2000)
    run_cycles(guard, 8 * g.MIN_SAMPLES, 1, drafting_tps=2500, plain_tps=1000)
    assert guard.buckets[bucket(64)].vetoed and not guard.buckets[bucket(1)].vetoed
    run_cycles(guard, 20 * g.PROBE_EVERY, 64, drafting_tps=3000, plain_tps=2000)  # the load changed
    assert not guard.buckets[bucket(64)].vetoed


def test_a_probe_is_judged_over_all_its_cycles_not_its_first_few() -> None:
    """A probe whose first cycles run 30 % ahead of plain and the rest 20 % behind (bf16 buckets at c=4 read
    like that: lifted, then vetoed again seconds later) leaves the veto on; judged on its first MIN_SAMPLES
    cycles it lifted, and the bucket flapped. A probe ahead throughout lifts it, at the probe's end."""
    for late_tps, lifted in ((1600, False), (2600, True)):
        guard = SpeculationGuard()
        run_cycles(guard, 8 * g.MIN_SAMPLES, 4, drafting_tps=1800, plain_tps=2000)
        b = guard.buckets[bucket(4)]
        assert b.vetoed
        probe: list[bool] = []
        while len(probe) < g.PROBE_CYCLES:
            drafts = guard.allows_drafting(4)
            if drafts:
                probe.append(b.vetoed)  # whether the veto still stood at this probe cycle
            tps = (2600 if len(probe) <= g.MIN_SAMPLES else late_tps) if drafts else 2000
            guard.observe(4, drafts, 8 if drafts else 4, (8 if drafts else 4) / tps)
        assert all(probe[:-1])  # no lift before the probe's last cycle
        assert (not b.vetoed) is lifted


def test_a_dip_in_a_steady_load_keeps_its_levels_verdict() -> None:
    """64 requests running, dipping to 48 for three cycles in every sixteen (requests finished, their successors
    not yet arrived). Drafting loses at 64 and would win at 48: once 64 is vetoed, the dips run plain too (with
    buckets of the instant count, every dip resumed drafting for every request, each paying its draft's
    catch-up), and their rates reach neither bucket's figures."""
    guard = SpeculationGuard()
    dips = []
    for i in range(2 * g.PROBE_EVERY_MAX):
        running = 48 if i % 16 >= 13 else 64
        drafts = guard.allows_drafting(running)
        if running == 48 and guard.buckets[bucket(64)].vetoed:
            dips.append(drafts)
        tokens = 2 * running if drafts else running
        tps = (1800 if running == 64 else 3000) if drafts else 2000
        guard.observe(running, drafts, tokens, tokens / tps)
    assert guard.buckets[bucket(64)].vetoed and len(dips) > 300
    assert sum(dips) / len(dips) <= g.PROBE_CYCLES / g.PROBE_EVERY  # the level's probes only
    assert bucket(48) not in guard.buckets


def test_a_load_that_falls_changes_bucket_after_the_load_window() -> None:
    guard = SpeculationGuard()
    run_cycles(guard, 8 * g.MIN_SAMPLES, 64, drafting_tps=1800, plain_tps=2000)
    assert guard.level() == bucket(64)
    for i in range(g.LOAD_WINDOW):
        assert guard.level() == bucket(64), i
        guard.allows_drafting(8)
    assert guard.level() == bucket(8)
    run_cycles(guard, 8 * g.MIN_SAMPLES, 8, drafting_tps=2500, plain_tps=1000)
    assert not guard.buckets[bucket(8)].vetoed and guard.buckets[bucket(8)].plain.samples >= g.MIN_SAMPLES


def test_catch_ups_in_prefill_steps_are_charged_to_drafting() -> None:
    """Clean drafting cycles 5 % ahead of plain ones, but every fourth drafting cycle also prefilled and spent
    40 % of a cycle catching the draft up: drafting costs more than it gains, and the bucket is vetoed. Without
    the charge, the clean cycles alone keep it on."""
    for charged, vetoed in ((True, True), (False, False)):
        guard = SpeculationGuard()
        for i in range(16 * g.MIN_SAMPLES):
            drafts = guard.allows_drafting(64)
            tokens = 64
            guard.observe(64, drafts, tokens, tokens / (2100 if drafts else 2000))
            if drafts and charged and i % 4 == 1:
                guard.charge(64, 0.4 * tokens / 2000)
        assert guard.buckets[bucket(64)].vetoed is vetoed


def ngram_engine_on_two_requests(kit: Any, llama_dir: Path, patch: Any, max_tokens: int) -> Any:
    """An adaptive n-gram engine (k <= 4) after `patch(speculator)` ran two greedy requests on a repetitive prompt
    (the n-gram proposer finds matches, so the policy wants to draft) to their end; returns the engine."""
    engine = kit.make_engine(llama_dir, speculative=SpeculativeConfig(enabled=True, method="ngram",
                                                                      num_draft_tokens=4))
    assert engine.speculator is not None and engine.speculator.guard is not None
    patch(engine.speculator)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(2):
        engine.add_request(GenerationRequest(f"r{i}", [5, 6, 7, 8] * 6, params))
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def test_an_engine_stops_drafting_where_drafting_is_slower(kit: Any, llama_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A proposer whose every proposal costs 20 ms (a tiny model's step is ~1 ms): the policy, which prices drafts
    by its own fits, is overruled by the clock, and the engine runs plain."""

    def slow_proposals(speculator: Any) -> None:
        propose = speculator.proposer.propose

        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.02)
            return propose(*args, **kwargs)

        monkeypatch.setattr(speculator.proposer, "propose", slow)

    engine = ngram_engine_on_two_requests(kit, llama_dir, slow_proposals, max_tokens=120)
    speculator = engine.speculator
    state = speculator.guard.buckets[bucket(2)]
    assert state.vetoed, speculator.guard.describe()
    assert speculator.guard.vetoed_cycles_total > 40
    # what /metrics exports (specdeploy_spec_guard_*): the engine's snapshot carries the guard's counts
    spec = engine.stats().spec
    assert spec.guard_vetoed_cycles == speculator.guard.vetoed_cycles_total
    assert spec.guard_vetoes == speculator.guard.vetoes_total >= 1
    assert spec.guard_cycles >= spec.guard_vetoed_cycles + spec.guard_plain_cycles
    assert spec.guard_plain_cycles == speculator.guard.forced_plain_total > 0


def test_cycles_the_policy_ran_at_k_0_count_as_drafting_cycles(kit: Any, llama_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Cycles are told apart by who decided them: a cycle left to the policy is a drafting cycle even where the
    policy chose k = 0 for every sequence, and the plain figure holds only the cycles the guard ran plain (the
    policy's k = 0 cycles cluster at a wave's heavy start and end, and counted as plain they would make drafting
    at a tie read as ahead)."""

    def no_drafts(speculator: Any) -> None:
        monkeypatch.setattr(speculator.policy, "choose", lambda candidates, *a, **kw: dict.fromkeys(candidates, 0))

    engine = ngram_engine_on_two_requests(kit, llama_dir, no_drafts, max_tokens=60)
    speculator = engine.speculator
    state = speculator.guard.buckets[bucket(2)]
    assert engine.stats().spec.num_draft_tokens == 0
    assert state.drafting.samples >= g.MIN_SAMPLES and state.plain.samples >= g.MIN_SAMPLES
    guard = speculator.guard
    assert state.plain.samples <= guard.forced_plain_total + guard.vetoed_cycles_total


def test_a_fixed_k_has_no_guard(kit: Any, llama_dir: Path) -> None:
    engine = kit.make_engine(llama_dir, speculative=SpeculativeConfig(enabled=True, method="ngram", adaptive=False))
    assert engine.speculator is not None and engine.speculator.guard is None
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine.add_request(GenerationRequest("r", [5, 6, 7, 8] * 6, params))
    while engine.has_unfinished_requests():
        engine.step()
    spec = engine.stats().spec
    assert spec.num_drafts > 0 and spec.guard_cycles == spec.guard_vetoed_cycles == spec.guard_vetoes == 0


def test_a_step_the_guard_runs_plain_leaves_the_proposer_alone(kit: Any, llama_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain cycle should cost what a spec-off step does: once the guard says no, nothing walks the requests for
    the proposer (no lag, no proposal, no rollback of drafts nobody made), however many are running."""
    calls: list[str] = []

    def plain_and_counted(speculator: Any) -> None:
        monkeypatch.setattr(speculator.guard, "allows_drafting", lambda num_running: False)
        for name in ("lag", "propose", "rollback"):
            method = getattr(speculator.proposer, name)

            def counted(*a: Any, _name: str = name, _method: Any = method, **kw: Any) -> Any:
                calls.append(_name)
                return _method(*a, **kw)

            monkeypatch.setattr(speculator.proposer, name, counted)

    engine = ngram_engine_on_two_requests(kit, llama_dir, plain_and_counted, max_tokens=30)
    assert engine.stats().spec.num_draft_tokens == 0
    assert calls == []
