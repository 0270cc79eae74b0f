from __future__ import annotations

import torch

from serving.engine.spec import rejection
from serving.engine.spec.rejection import rejection_sample, verify_greedy

V = 5
SAMPLES = 6000
CHI2_CRITICAL_DF4 = 18.47  # p = 0.001


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def first_token_counts(p: torch.Tensor, q: torch.Tensor | None, draft_from: torch.Tensor) -> torch.Tensor:
    """Emit with two drafts drawn from draft_from; count the first emitted token."""
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    for _ in range(SAMPLES):
        drafts = torch.multinomial(draft_from, 1, generator=g).squeeze(1).tolist()
        counts[rejection_sample(p, drafts, q, g)[0]] += 1
    return counts


def distributions(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    return p, q


def test_sampled_drafts_leave_the_target_distribution_unchanged() -> None:
    p, q = distributions(1)
    assert chi_square(first_token_counts(p, q, q), p[0]) < CHI2_CRITICAL_DF4


def test_deterministic_drafts_leave_the_target_distribution_unchanged() -> None:
    p, _ = distributions(2)
    fixed = torch.zeros(2, V)
    fixed[:, 3] = 1.0  # an n-gram proposer always proposing token 3: q is one-hot
    assert chi_square(first_token_counts(p, None, fixed), p[0]) < CHI2_CRITICAL_DF4


def test_the_test_has_power_against_a_broken_rule(monkeypatch) -> None:
    p, q = distributions(1)

    def broken(p: torch.Tensor, drafts: list[int], q: torch.Tensor | None, generator: torch.Generator) -> list[int]:
        # wrong: after a rejection, resample from p instead of normalize(max(0, p - q))
        u = torch.rand(len(drafts) + 1, generator=generator)
        for i, x in enumerate(drafts):
            qx = q[i, x] if q is not None else 1.0
            if u[i] * qx > p[i, x]:
                return drafts[:i] + [int(torch.multinomial(p[i], 1, generator=generator))]
        return drafts + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))]

    monkeypatch.setattr(rejection, "rejection_sample", broken)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    for _ in range(SAMPLES):
        drafts = torch.multinomial(q, 1, generator=g).squeeze(1).tolist()
        counts[rejection.rejection_sample(p, drafts, q, g)[0]] += 1
    assert chi_square(counts, p[0]) > CHI2_CRITICAL_DF4


def test_all_accepted_drafts_get_a_bonus_token_from_the_last_position() -> None:
    p = torch.zeros(3, V)
    p[0, 1] = p[1, 2] = p[2, 4] = 1.0
    assert rejection_sample(p, [1, 2], None, torch.Generator().manual_seed(0)) == [1, 2, 4]


def test_greedy_verification_stops_at_the_first_mismatch() -> None:
    assert verify_greedy([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert verify_greedy([1], []) == [1]
