"""A request's early drafts are a population of their own, and one busy step is one step of evidence.

The first tokens after a prompt are the hardest to guess (demo pair, 40 held-out code prompts: the draft agreed
with the target's greedy token at output position 1 in 75 % of cases, from position 2 on in 86-89 %). At 64
sequences their first verifications all land in one step; counted with everything else they turned the global
estimate from 0.97 to ~0.65 and the batch stopped speculating for good."""

from __future__ import annotations

import pytest

from serving.engine.spec.policy import SpeculationPolicy


def _steady(policy: SpeculationPolicy, steps: int = 40, width: int = 16) -> None:
    """`steps` engine steps in which `width` sequences each verify 8 drafts, ~0.97 of them accepted."""
    for step in range(steps):
        policy.observe_verifications([(f"s{i}", 8 if (step + i) % 4 else 7, 8, False) for i in range(width)])
    for i in range(width):
        policy.forget(f"s{i}")


def test_one_step_of_many_verifications_fades_the_history_once() -> None:
    """57 sequences verifying in one step are one step: faded once per verification (0.95^57 = 0.05) the history
    vanished and the estimate became that step alone."""
    policy = SpeculationPolicy(max_k=8)
    _steady(policy)
    before = policy.global_rate()
    assert before > 0.95
    policy.observe_verifications([(f"b{i}", 0, 3, False) for i in range(57)])  # a bad step, every draft rejected
    after = policy.global_rate()
    assert after < before  # it counts...
    assert after > 0.9  # ...as one step of ~40


def test_early_verifications_are_tracked_apart_from_every_other_estimate() -> None:
    policy = SpeculationPolicy(max_k=8)
    _steady(policy)
    shared, long_run = policy.global_rate(), policy.long_run_acceptance.rate
    policy.observe_verifications([(f"n{i}", 0, 3, True) for i in range(57)])  # first drafts, all rejected at once
    assert policy.global_rate() == pytest.approx(shared)
    assert policy.long_run_acceptance.rate == pytest.approx(long_run)
    assert policy.acceptance("n0") == pytest.approx(shared)  # the request's own estimate is untouched
    assert policy.early_rate() < 0.3
    assert policy.acceptance("n0", early=True) == pytest.approx(policy.early_rate())


def test_the_early_rate_leans_on_the_global_rate_until_early_drafts_are_seen() -> None:
    policy = SpeculationPolicy(max_k=8)
    _steady(policy)
    assert policy.early_rate() == pytest.approx(policy.global_rate())
    policy.observe_verification("n", 8, 8, early=True)
    assert policy.early_rate() == pytest.approx(policy.global_rate(), abs=0.05)


def _cheap_steps(policy: SpeculationPolicy) -> None:
    for tokens in (2, 4, 8, 16, 32):  # overhead-bound: a verify token costs 0.1 ms beside a 5 ms step
        policy.observe_target_step(tokens, 0.005 + 0.0001 * tokens)
        policy.observe_draft_forward(tokens, 0.0002 + 0.00001 * tokens)


def test_an_early_candidate_is_weighed_at_the_early_rate() -> None:
    policy = SpeculationPolicy(max_k=8)
    _cheap_steps(policy)
    _steady(policy)
    for i in range(40):
        policy.observe_verification(f"n{i}", 0, 8, early=True)  # early drafts: rejected at once
    ks = policy.choose({"young": 8, "old": 8}, num_decodes=2, early={"young"})
    assert ks["old"] >= 4
    assert ks["young"] < ks["old"]


def test_describe_reports_what_a_choice_saw_and_chose() -> None:
    policy = SpeculationPolicy(max_k=8)
    _cheap_steps(policy)
    _steady(policy)
    for i in range(40):
        policy.observe_verification(f"n{i}", 0, 8, early=True)
    candidates = {"young": 8, "old": 8, "capped": 2}
    ks = policy.choose(candidates, num_decodes=3, early={"young"})
    seen = policy.describe(candidates, 3, {"young": 1.0, "old": 1.0, "capped": 3.0}, {"young"}, ks)
    assert seen["candidates"] == 3 and seen["decoding"] == 3 and seen["early"] == 1
    assert seen["k"] == {k: list(ks.values()).count(k) for k in sorted(set(ks.values()))}
    low, median, high = seen["alpha"]  # type: ignore[misc]
    assert low == pytest.approx(policy.early_rate(), abs=1e-4) and low < median <= high
    assert seen["catch_up"] == [1.0, 1.0, 3.0]
    assert seen["target_cost_ms"] == [pytest.approx(policy.target_cost.intercept * 1e3, abs=1e-4),
                                      pytest.approx(policy.target_cost.slope * 1e3, abs=1e-4)]

