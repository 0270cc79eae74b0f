from __future__ import annotations

import pytest

from serving.engine.spec.policy import LinearCost, SpeculationPolicy, expected_tokens


def trained_policy(accepted_of_4: int = 1) -> SpeculationPolicy:
    """Target: 10 ms per step + 0.5 ms per token; draft: 1 ms per forward; per-token acceptance ~ 0.5."""
    policy = SpeculationPolicy(max_k=4, uses_draft_model=True)
    for tokens in (1, 2, 5, 8, 16, 32, 64, 128):
        policy.observe_target_step(tokens, 0.010 + 0.0005 * tokens)
    for tokens in (1, 2, 4, 8, 16, 32, 128):
        policy.observe_draft_forward(tokens, 0.001 + 0.00002 * tokens)
    for _ in range(20):
        policy.observe_verification("r", accepted_of_4, 4)
    return policy


def test_cost_fit_recovers_intercept_and_slope() -> None:
    cost = LinearCost(intercept=0.0, slope=0.0)
    for x in range(1, 40):
        cost.observe(x, 0.004 + 0.001 * x)
    assert abs(cost.intercept - 0.004) < 1e-4 and abs(cost.slope - 0.001) < 1e-5


def test_one_cold_step_does_not_set_the_slope() -> None:
    """Steps of 4 tokens at 2.4 ms, one 41-token step at 15 ms (cold caches: 2.3x the line's 6.5 ms), then 4-token
    steps again. Least squares through the two clusters would put the slope at 0.35 ms a token for as long as no
    other x arrives; clipped to three typical misses, the cold step moves it a little."""
    cost = LinearCost(intercept=0.002, slope=1e-4)
    for tokens in (1, 4, 9, 4, 1, 9, 4, 4, 9, 1, 4, 4):
        cost.observe(tokens, 0.002 + 1e-4 * tokens + (2e-5 if tokens % 2 else -2e-5))
    cost.observe(41, 0.015)
    for _ in range(60):
        cost.observe(4, 0.0024)
    assert cost.slope < 1.5e-4
    # a real change of cost still comes through: every step now costs twice as much
    for tokens in [1, 4, 9] * 40:
        cost.observe(tokens, 2 * (0.002 + 1e-4 * tokens))
    assert cost.intercept == pytest.approx(0.004, rel=0.1) and cost.slope == pytest.approx(2e-4, rel=0.1)


def test_speculates_at_low_load() -> None:
    ks = trained_policy().choose({"r": 4}, num_decodes=1)
    assert ks["r"] >= 2


def test_backs_off_when_the_batch_is_full() -> None:
    # 64 decodes: a verify token costs 0.5 ms while an emitted token is worth ~0.66 ms, and only half the
    # draft tokens are accepted: speculation would lose
    policy = trained_policy()
    candidates = {f"r{i}": 4 for i in range(64)}
    assert set(policy.choose(candidates, num_decodes=64).values()) == {0}


def test_high_acceptance_pays_even_in_a_full_batch() -> None:
    policy = trained_policy(accepted_of_4=4)
    candidates = {f"r{i}": 4 for i in range(64)}
    assert min(policy.choose(candidates, num_decodes=64).values()) > 0


def test_fixed_mode_always_uses_k() -> None:
    policy = SpeculationPolicy(max_k=3, adaptive=False)
    assert policy.choose({"a": 5, "b": 2}, 2) == {"a": 3, "b": 2}


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-9


def test_a_long_draft_catch_up_is_part_of_the_cost() -> None:
    policy = trained_policy(accepted_of_4=2)
    assert policy.choose({"r": 4}, 1, catch_up={"r": 1})["r"] > 0
    assert policy.choose({"r": 4}, 1, catch_up={"r": 5000})["r"] == 0  # 100 ms of draft prefill


def test_k_is_chosen_per_request_by_acceptance() -> None:
    policy = trained_policy(accepted_of_4=4)
    for _ in range(30):
        policy.observe_verification("bad", 0, 4)
    ks = policy.choose({"r": 4, "bad": 4}, 2)
    assert ks["r"] >= 2 and ks["bad"] < ks["r"]


def test_a_request_left_at_zero_is_probed_now_and_then() -> None:
    policy = trained_policy()
    candidates = {f"r{i}": 4 for i in range(64)}
    chosen = [policy.choose(candidates, 64)["r0"] for _ in range(policy.explore_after)]
    assert chosen[:-1] == [0] * (policy.explore_after - 1) and chosen[-1] == 1


def test_a_flat_draft_cost_is_weighed_for_the_whole_k_of_a_lone_request() -> None:
    """A compiled rollout drafts any k for one fixed cost. Position by position, the first position pays the
    draft's forward alone; weighed as a whole, every position after it costs only its verify token."""
    policy = SpeculationPolicy(max_k=8, uses_draft_model=True)
    for tokens in (1, 2, 5, 9):
        policy.observe_target_step(tokens, 0.0025 + 0.00006 * tokens)  # a c=1 CPU step: 2.5 ms + 0.06 ms/token
    for tokens in (1, 2, 4):
        policy.observe_draft_forward(tokens, 0.0004 + 0.00002 * tokens)  # an eager draft forward: ~0.4 ms
    for _ in range(20):
        policy.observe_verification("r", 5, 8)  # acceptance ~0.7 per position
    stepwise = policy.choose({"r": 8}, num_decodes=1)["r"]
    whole = policy.choose({"r": 8}, num_decodes=1, flat_draft_seconds=0.0015)["r"]
    assert whole == 8 > stepwise
    # a rollout dearer than the whole gain: the position-by-position choice stands
    assert policy.choose({"r": 8}, num_decodes=1, flat_draft_seconds=0.5)["r"] == stepwise
    # several candidates: a rollout serves one sequence only, so the flat cost is not used
    two = {"r": 8, "s": 8}
    assert policy.choose(two, 2, flat_draft_seconds=0.0015) == policy.choose(two, 2)


def _sixteen_sequence_policy(sequence_seconds: float, max_k: int = 8) -> SpeculationPolicy:
    """16 decoding sequences on CPU: a target step 2.4 ms + 0.1 ms a token, a draft forward 0.4 ms + 0.035 ms a
    token, the speculator's own work per speculating sequence; every request accepting 0.98 per position."""
    policy = SpeculationPolicy(max_k=max_k, uses_draft_model=True)
    for tokens in (1, 4, 16, 32, 64, 112):
        policy.observe_target_step(tokens, 0.0024 + 0.0001 * tokens)
        policy.observe_draft_forward(tokens, 0.0004 + 0.000035 * tokens)
    for _ in range(4):
        policy.observe_speculator_work(16, 0.0001 + sequence_seconds * 16)
        policy.observe_speculator_work(1, 0.0001 + sequence_seconds)
    for i in range(16):
        for _ in range(10):
            policy.observe_verification(f"r{i}", 49, 50)
    return policy


def test_a_shared_k_is_weighed_where_no_single_position_pays_for_itself() -> None:
    """A sequence's own overhead (0.2 ms here, what the draft proposer measured at its dearest) and each draft
    forward's fixed cost fall on the first position when k is chosen position by position, and that position
    alone does not earn them: with k at most 1 nobody drafts. Every sequence drafting the same deeper k does
    earn them, and that plan is taken (measured at 16 sequences of the demo pair: position by position
    0.88-0.93x spec-off, every sequence at k = 6 1.14-1.22x)."""
    candidates = {f"r{i}": 8 for i in range(16)}
    assert set(_sixteen_sequence_policy(2e-4, max_k=1).choose(candidates, 16).values()) == {0}
    policy = _sixteen_sequence_policy(2e-4)
    ks = policy.choose(candidates, 16)
    assert len(set(ks.values())) == 1 and min(ks.values()) >= 4
    # verify tokens ten times dearer: no plan pays, nobody drafts
    policy.target_cost.intercept, policy.target_cost.slope = 0.0024, 0.001
    assert set(policy.choose(candidates, 16).values()) == {0}


def test_each_speculating_sequence_is_charged_the_speculators_own_work() -> None:
    """Proposing and bookkeeping cost per sequence outside both forwards; fitted, they are part of the price
    (here 3 ms a sequence: more than its drafts could earn)."""
    candidates = {f"r{i}": 8 for i in range(16)}
    assert max(_sixteen_sequence_policy(2e-5).choose(candidates, 16).values()) > 0
    dear = _sixteen_sequence_policy(3e-3)
    assert dear.sequence_cost.slope == pytest.approx(3e-3, rel=0.05)
    assert set(dear.choose(candidates, 16).values()) == {0}


def test_one_poor_first_verification_does_not_sink_a_request() -> None:
    """A request's own estimate leans on the global rate for a verification's worth of positions: a first
    verification rejected at once (common right after a prompt) leaves it near the pair's rate, where a
    2-position prior had put it at ~0.62, below every plan, and it never drafted again to correct it."""
    policy = SpeculationPolicy(max_k=8, uses_draft_model=True)
    for i in range(200):
        policy.observe_verification(f"r{i % 16}", 8 if i % 4 else 7, 8)  # the pair accepts ~0.97 per position
    policy.observe_verification("new", 0, 8)
    assert policy.acceptance("new") > 0.85
    for _ in range(4):  # and a request that keeps missing still comes down
        policy.observe_verification("new", 0, 8)
    assert policy.acceptance("new") < 0.7
