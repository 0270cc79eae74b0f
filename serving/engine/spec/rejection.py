"""Verification of draft tokens against the target: coupled (Gumbel-max) speculative sampling.

Output position t of a request has its own noise E_t (one Exp(1) draw per token, a function of the
request's seed and t alone: sampling.position_noise). Both models race on it:

    the draft proposes   x_t = argmax(q_t / E_t)      (q_t: its processed distribution)
    the target emits     y_t = argmax(p_t / E_t)      (an exact sample of p_t, as plain sampling draws it)
    draft x_t is accepted iff x_t == y_t; at the first mismatch y_t is emitted; all k accepted → y_{t+k}.

Every emitted token is y_t, computed from p_t and E_t only, so the text is the one plain sampling gives
with the same seed, whatever k was and whatever the draft proposed: the draft decides how many tokens a
verification emits, never which. Greedy requests are the E = 1 case (argmax of the logits). Deterministic
drafts (n-gram lookup) are accepted with probability p_t(x), as under rejection sampling; a model's drafts
with P(argmax(q/E) == argmax(p/E)) >= (1 - TV) / (1 + TV) (TV the total variation distance between p_t and
q_t), below rejection sampling's min(p, q) mass 1 - TV, which would make the text depend on k (docs/server.md).
"""

from __future__ import annotations


def accept_drafts(target_tokens: list[int], drafts: list[int]) -> list[int]:
    """target_tokens[j]: the target's token at draft position j (k + 1 of them); keep drafts while they equal
    it, then emit the target's token at the first mismatch (or after the last draft)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_tokens[accepted]:
        accepted += 1
    return drafts[:accepted] + [target_tokens[accepted]]
