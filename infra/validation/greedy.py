"""Greedy text with speculation on against off: identical, parted by rounding at a near-tie, or a real divergence.

Speculation is lossless: the target verifies every draft and keeps only its own greedy token. Verification
computes a sequence's next positions as rows of one forward (k + 1 query tokens), decoding computes them one
at a time, and the two take their matmul and attention reductions in different orders. In fp32 the difference
is far below any gap between two tokens (the demo target: at most 1.1e-5 in log-probability between a verify row
and a decode row of the same position). In bf16 and fp16 it is not: the same comparison on the demo target
differs by up to 0.089, so where the target's top two tokens are that close (a near-tie) the arms may pick
different ones, and the texts part from there. That is rounding, not a bug; anything else is.

The check takes both arms' outputs with their top log-probabilities, finds the first token where they differ
and asks the spec-off arm how far apart its choice and the spec-on arm's choice were at that position: within
the serving precision's rounding (ROUNDING_TOLERANCE), the texts parted at a near-tie; beyond it, or where the
spec-on token is not among the spec-off arm's top tokens at all, speculation changed the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# log-probability gap (nats) between the top two tokens under which a flip counts as rounding, per precision:
# ~3x the largest verify-vs-decode difference measured on the demo target (bf16 0.089, fp32 1.1e-5)
ROUNDING_TOLERANCE = {"fp32": 1e-3, "fp16": 0.1, "bf16": 0.25}


@dataclass(frozen=True)
class TokenStep:
    token: str
    logprob: float
    top: dict[str, float]  # the top tokens at this position and their log-probabilities


@dataclass(frozen=True)
class Divergence:
    position: int  # the first generated token that differs
    rounding: bool  # True: a near-tie within the precision's rounding
    message: str


def token_steps(payload: dict[str, Any]) -> list[TokenStep]:
    """Per generated token, from a non-streaming completion (logprobs=N) or chat completion (logprobs=true,
    top_logprobs=N) response."""
    choice = payload["choices"][0]
    logprobs = choice.get("logprobs")
    if not logprobs:
        raise ValueError("the response carries no logprobs: ask with logprobs (completions) or top_logprobs (chat)")
    if "content" in logprobs:  # chat
        return [TokenStep(e["token"], float(e["logprob"]), {t["token"]: float(t["logprob"]) for t in e["top_logprobs"]})
                for e in logprobs["content"]]
    return [TokenStep(token, float(lp), {k: float(v) for k, v in (top or {}).items()})
            for token, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                                      strict=True)]


def classify(off: list[TokenStep], on: list[TokenStep], dtype: str) -> Divergence | None:
    """None where the token sequences are identical; else where and how they part (see the module docstring)."""
    tolerance = ROUNDING_TOLERANCE.get(dtype, ROUNDING_TOLERANCE["bf16"])
    for position, (a, b) in enumerate(zip(off, on, strict=False)):
        if a.token == b.token:
            continue
        if b.token not in a.top:
            return Divergence(position, False, f"token {position}: spec on wrote {b.token!r}, which is not among the "
                                               f"spec-off arm's top tokens there ({sorted(a.top)}): a real divergence")
        gap = a.logprob - a.top[b.token]
        rounding = gap <= tolerance
        verdict = (f"within {dtype} rounding ({tolerance:g}): a near-tie" if rounding else
                   f"beyond {dtype} rounding ({tolerance:g}): speculation changed the output")
        return Divergence(position, rounding, f"token {position}: spec off wrote {a.token!r}, spec on {b.token!r}; "
                                              f"their log-probabilities differ by {gap:.4f} at spec off, {verdict}")
    if len(off) != len(on):
        shorter = min(len(off), len(on))
        return Divergence(shorter, False, f"identical for {shorter} tokens, then one arm stopped: spec off wrote "
                                          f"{len(off)} tokens, spec on {len(on)}")
    return None
