"""The launch check's verdict on greedy texts that part with speculation on (infra/validation/greedy.py), on
responses in the server's own logprobs shapes (serving/api/render/logprobs.py)."""

from __future__ import annotations

from typing import Any

import pytest

from infra.validation.greedy import ROUNDING_TOLERANCE, classify, token_steps
from serving.api.render.logprobs import chat_logprobs, completion_logprobs
from serving.engine.types import TokenLogprobs


def response(tokens: list[tuple[int, list[tuple[int, float]]]], chat: bool) -> dict[str, Any]:
    """A response as the server writes it: each generated token with its top (token, logprob), best first."""
    entries = [TokenLogprobs(token, dict(top)[token], top) for token, top in tokens]
    logprobs = chat_logprobs(None, entries) if chat else completion_logprobs(None, entries, 0)
    return {"choices": [{"logprobs": logprobs}]}


# spec off: 1, 2, 3 with 3 beating 4 by `gap` at the third token
def arms(gap: float, on_third: int, chat: bool) -> tuple[list[Any], list[Any]]:
    off = [(1, [(1, -0.1), (9, -3.0)]), (2, [(2, -0.2), (9, -2.5)]), (3, [(3, -0.6), (4, -0.6 - gap)])]
    on = [*off[:2], (on_third, [(on_third, -0.6), (3, -0.6 - gap)])]
    return token_steps(response(off, chat)), token_steps(response(on, chat))


@pytest.mark.parametrize("chat", [False, True])
def test_identical_texts_pass(chat: bool) -> None:
    off, _ = arms(0.5, 3, chat)
    assert classify(off, off, "bf16") is None


@pytest.mark.parametrize("chat", [False, True])
def test_a_flip_at_a_near_tie_is_rounding_in_bf16_and_a_bug_in_fp32(chat: bool) -> None:
    off, on = arms(0.05, 4, chat)
    verdict = classify(off, on, "bf16")
    assert verdict is not None and verdict.rounding and verdict.position == 2
    assert "within bf16 rounding" in verdict.message and "0.0500" in verdict.message
    verdict = classify(off, on, "fp32")  # fp32 rows round alike: the same flip is a real divergence
    assert verdict is not None and not verdict.rounding and "beyond fp32 rounding" in verdict.message


def test_a_flip_past_the_tolerance_is_a_real_divergence() -> None:
    off, on = arms(ROUNDING_TOLERANCE["bf16"] * 2, 4, False)
    verdict = classify(off, on, "bf16")
    assert verdict is not None and not verdict.rounding and "speculation changed the output" in verdict.message


def test_a_token_outside_the_off_arms_top_tokens_is_a_real_divergence() -> None:
    off, on = arms(0.01, 7, False)
    verdict = classify(off, on, "bf16")
    assert verdict is not None and not verdict.rounding and "not among the spec-off arm's top tokens" in verdict.message


def test_an_arm_that_stops_early_is_a_real_divergence() -> None:
    off, _ = arms(0.5, 3, False)
    verdict = classify(off, off[:2], "bf16")
    assert verdict is not None and not verdict.rounding and "spec off wrote 3 tokens, spec on 2" in verdict.message


def test_a_response_without_logprobs_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="no logprobs"):
        token_steps({"choices": [{"text": "x"}]})
