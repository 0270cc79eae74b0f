"""Issue 18 item 7: after overload pushed k to 0 (and acceptance estimates down), speculation comes back
within a few seconds of load dropping, even for short requests that never reach a per-request probe."""

from __future__ import annotations

import pytest

from serving.engine.spec.policy import SpeculationPolicy


def _overload(policy: SpeculationPolicy) -> None:
    # full batches: the step is token-bound (no visible overhead) and the last verifications were rejected
    for step in range(400):
        tokens = 192 + step % 64
        policy.observe_target_step(tokens, 4e-3 * tokens)
        if step % 4 == 0:
            policy.observe_verification(f"busy{step % 64}", 0, 4)
    for i in range(64):
        policy.forget(f"busy{i}")


def _quiet_requests(policy: SpeculationPolicy, requests: int, steps_each: int) -> list[int]:
    """Drafted positions per step at batch 1 with good drafts (every draft accepted)."""
    drafted = []
    for r in range(requests):
        rid = f"quiet{r}"
        for _ in range(steps_each):
            k = policy.choose({rid: 4}, num_decodes=1)[rid]
            policy.observe_target_step(1 + k, 0.02 + 4e-3 * (1 + k))  # CPU-like: a verify token is not free
            if k:
                policy.observe_verification(rid, k, k)
            drafted.append(k)
        policy.forget(rid)
    return drafted


def test_speculation_recovers_after_overload_for_short_requests() -> None:
    policy = SpeculationPolicy(max_k=4, uses_draft_model=False)
    _overload(policy)
    assert policy.choose({"first": 4}, 1)["first"] == 0  # overload left it off
    policy.forget("first")
    drafted = _quiet_requests(policy, requests=30, steps_each=10)  # 300 steps: a few seconds of decoding
    first_on = next((i for i, k in enumerate(drafted) if k), None)
    assert first_on is not None and first_on <= 64, f"no drafts for {first_on} steps"
    tail = drafted[-100:]
    assert sum(1 for k in tail if k) >= 90, tail  # and it stays on


def test_a_quiet_policy_still_speculates_from_the_start() -> None:
    policy = SpeculationPolicy(max_k=4, uses_draft_model=False)
    assert all(_quiet_requests(policy, requests=3, steps_each=5))


def test_an_idle_estimate_returns_to_the_pairs_long_run_acceptance_not_the_prior() -> None:
    """A pair that accepts 0.95 and sits out a busy stretch (nobody drafts, the recent counts fade) must come back
    at ~0.95: relaxing to the fixed prior (0.6) made 4-16 sequences look not worth drafting for, so nothing
    drafted again to correct it. A pair that really accepts little still relaxes to the prior, as above."""
    policy = SpeculationPolicy(max_k=4, uses_draft_model=True)
    for i in range(300):
        policy.observe_verification(f"r{i % 8}", 19 if i % 5 else 18, 20)  # 99 of 100 drafts accepted
    for i in range(8):
        policy.forget(f"r{i}")
    for _ in range(200):
        policy.global_acceptance.relax()  # what a step without drafts does
    assert policy.global_acceptance.tested < 1  # the recent counts are gone
    assert policy.acceptance("new") > 0.9
    weak = SpeculationPolicy(max_k=4, uses_draft_model=True)
    for _ in range(300):
        weak.observe_verification("w", 0, 4)
    for _ in range(200):
        weak.global_acceptance.relax()
    assert weak.acceptance("new") == pytest.approx(weak.global_acceptance.prior, abs=0.01)
