from __future__ import annotations

import torch

from serving.engine.sampling import position_noise, race
from serving.engine.spec import rejection
from serving.engine.spec.rejection import accept_drafts, rejection_sample

V = 5
SAMPLES = 6000
CHI2_CRITICAL_DF4 = 18.47  # p = 0.001


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def distributions(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    return p, q


def verify(p: torch.Tensor, q: torch.Tensor, seed: int, verify_rule=accept_drafts) -> tuple[list[int], list[int]]:
    """Two drafts raced from q and verified against p on the noise of positions 0..2; also the plain tokens."""
    noise = position_noise([(seed, t) for t in range(3)], V, torch.device("cpu"))
    drafts = race(q, noise[:2]).tolist()
    target = race(p, noise).tolist()
    return verify_rule(target, drafts), target


def test_coupled_drafts_leave_the_target_distribution_unchanged() -> None:
    p, q = distributions(1)
    counts = torch.zeros(V)
    for seed in range(SAMPLES):
        counts[verify(p, q, seed)[0][0]] += 1
    assert chi_square(counts, p[0]) < CHI2_CRITICAL_DF4


def test_the_test_has_power_against_a_broken_rule() -> None:
    def accept_everything(target: list[int], drafts: list[int]) -> list[int]:
        return drafts + [target[len(drafts)]]

    p, q = distributions(1)
    counts = torch.zeros(V)
    for seed in range(SAMPLES):
        counts[verify(p, q, seed, accept_everything)[0][0]] += 1
    assert chi_square(counts, p[0]) > CHI2_CRITICAL_DF4


def test_emitted_tokens_are_the_plain_samples_whatever_the_draft() -> None:
    """The point of the coupling: what a verification emits is a prefix of what plain sampling with the same
    noise gives, so the text does not depend on k or on the draft."""
    p, q = distributions(3)
    for seed in range(200):
        emitted, plain = verify(p, q, seed)
        assert emitted == plain[: len(emitted)]


def test_acceptance_lies_between_the_coupling_bound_and_rejection_sampling() -> None:
    """P(draft accepted) >= (1 - TV) / (1 + TV) for the exponential race; rejection sampling reaches 1 - TV."""
    p, q = distributions(4)
    tv = float((p[0] - q[0]).abs().sum()) / 2
    accepted = sum(verify(p, q, seed)[0][0] == race(q, position_noise([(seed, 0)], V, torch.device("cpu")))[0]
                   for seed in range(SAMPLES)) / SAMPLES
    assert (1 - tv) / (1 + tv) - 0.02 < accepted < 1 - tv + 0.02


def rejected_first_tokens(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Rejection sampling (unseeded requests): two drafts drawn from q; count the first emitted token."""
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    for _ in range(SAMPLES):
        drafts = torch.multinomial(q, 1, generator=g).squeeze(1).tolist()
        counts[rejection.rejection_sample(p, drafts, q, g)[0]] += 1
    return counts


def test_rejection_sampling_leaves_the_target_distribution_unchanged() -> None:
    p, q = distributions(1)
    assert chi_square(rejected_first_tokens(p, q), p[0]) < CHI2_CRITICAL_DF4


def test_the_rejection_test_has_power_against_a_broken_rule(monkeypatch) -> None:
    def broken(p: torch.Tensor, drafts: list[int], q: torch.Tensor, generator: torch.Generator) -> list[int]:
        # wrong: after a rejection, resample from p instead of normalize(max(0, p - q))
        u = torch.rand(len(drafts) + 1, generator=generator)
        for i, x in enumerate(drafts):
            if u[i] * q[i, x] > p[i, x]:
                return drafts[:i] + [int(torch.multinomial(p[i], 1, generator=generator))]
        return drafts + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))]

    monkeypatch.setattr(rejection, "rejection_sample", broken)
    p, q = distributions(1)
    assert chi_square(rejected_first_tokens(p, q), p[0]) > CHI2_CRITICAL_DF4


def test_rejection_sampling_accepts_more_than_the_coupling() -> None:
    """Why unseeded requests keep it: acceptance 1 - TV, against at least (1 - TV) / (1 + TV) coupled."""
    p, q = distributions(4)
    g = torch.Generator().manual_seed(0)
    accepted = 0
    for _ in range(SAMPLES):
        draft = torch.multinomial(q[0], 1, generator=g).tolist()
        accepted += rejection_sample(p[:2], draft, q[:1], g)[0] == draft[0]
    tv = float((p[0] - q[0]).abs().sum()) / 2
    assert abs(accepted / SAMPLES - (1 - tv)) < 0.02


def test_all_accepted_drafts_get_a_bonus_token_from_the_last_position() -> None:
    p = torch.zeros(3, V)
    p[0, 1] = p[1, 2] = p[2, 4] = 1.0
    assert rejection_sample(p, [1, 2], p[:2], torch.Generator().manual_seed(0)) == [1, 2, 4]


def test_all_accepted_drafts_get_the_target_token_after_them() -> None:
    assert accept_drafts([1, 2, 4], [1, 2]) == [1, 2, 4]


def test_verification_stops_at_the_first_mismatch() -> None:
    assert accept_drafts([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert accept_drafts([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert accept_drafts([1], []) == [1]
