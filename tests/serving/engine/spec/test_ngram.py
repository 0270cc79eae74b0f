from __future__ import annotations

import pytest

from serving.engine.request import Request
from serving.engine.spec.ngram import NgramProposer
from serving.engine.types import SamplingParams


def request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(), eos_token_ids=[], max_model_len=64, tokenizer=None,
                   default_seed=0)


def test_longest_suffix_match_proposes_what_followed() -> None:
    proposer = NgramProposer(n_min=1, n_max=3)
    # suffix [1, 2, 3] occurred before, followed by 4, 9
    assert proposer.propose_one([1, 2, 3, 4, 9, 7, 1, 2, 3], 2) == [4, 9]


def test_most_recent_match_wins_and_k_caps_the_proposal() -> None:
    proposer = NgramProposer(n_min=1, n_max=2)
    assert proposer.propose_one([5, 1, 6, 5, 1, 7, 8, 5, 1], 1) == [7]


def test_no_match_no_proposal() -> None:
    proposer = NgramProposer(n_min=2, n_max=3)
    assert proposer.propose_one([1, 2, 3, 4], 3) == []
    proposals = proposer.propose([request("a", [1, 2, 1, 2]), request("b", [1, 2, 3])], {"a": 2, "b": 2})
    assert proposals.tokens == {"a": [1, 2]}
    assert not proposals.forward_seconds  # no model ran


def _reference(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Every window of every length compared by hand: what propose_one must answer."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == suffix]
        if starts:
            return tokens[starts[-1] + n : starts[-1] + n + k]
    return []


@pytest.mark.parametrize("vocab", [2, 5, 50])
def test_proposals_equal_a_window_by_window_search(vocab: int) -> None:
    import random

    rng = random.Random(vocab)
    proposer = NgramProposer(n_min=1, n_max=4)
    for _ in range(300):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        k = rng.randrange(0, 6)
        want = _reference(tokens, k, 1, 4) if k > 0 and len(tokens) >= 2 else []
        assert proposer.propose_one(tokens, k) == want, tokens
    assert NgramProposer(n_min=2, n_max=3).propose_one([1, 2, 9, 1, 2], 2) == [9, 1]
    assert NgramProposer(n_min=2, n_max=3).propose_one([7, 2, 9, 1, 2], 2) == []  # a 1-token match is too short
