"""Verification of draft tokens against the target: coupled (Gumbel-max) speculative sampling for seeded and greedy
requests, rejection sampling for the model drafts of unseeded ones.

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

A request without a seed has no text to reproduce, so its model drafts (q known) are verified the classic way:

    accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), in order, stopping at the first rejection;
    at a rejection at i, emit a sample from normalize(max(0, p_i - q_i)) instead of x_i;
    if all k are accepted, emit a bonus token sampled from p_{k+1}.

Its draws come from the request's own generator, independent of the noise the draft raced on (an exact sample
of q is all the rule asks of a draft). Deterministic drafts (n-gram) are coupled either way: their acceptance
p(x) is the same under both rules.
"""

from __future__ import annotations

import torch

from serving.engine.sampling import sample_from_probs


def accept_drafts(target_tokens: list[int], drafts: list[int]) -> list[int]:
    """target_tokens[j]: the target's token at draft position j (k + 1 of them); keep drafts while they equal
    it, then emit the target's token at the first mismatch (or after the last draft)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_tokens[accepted]:
        accepted += 1
    return drafts[:accepted] + [target_tokens[accepted]]


def rejection_sample(p: torch.Tensor, drafts: list[int], q: torch.Tensor, generator: torch.Generator) -> list[int]:
    """p [k + 1, V] target probs, q [k, V] the draft's probs for its k drafts; returns the emitted tokens."""
    k = len(drafts)
    uniforms = 1.0 - torch.rand(k + 1, generator=generator)  # (0, 1]; k acceptance tests + the final draw
    draft_ids = torch.tensor(drafts, dtype=torch.long, device=p.device)
    rows = torch.arange(k, device=p.device)
    p_x, q_x = p[rows, draft_ids], q[rows, draft_ids]
    # u <= p(x) / q(x), written without the division (q(x) > 0 for anything the draft proposed)
    accept = uniforms[:k].to(p.device) * q_x <= p_x
    accepted = int(accept.to(torch.int64).cumprod(0).sum()) if k else 0
    final = p[k]
    if accepted < k:
        final = (p[accepted] - q[accepted]).clamp_(min=0.0)
        if float(final.sum()) <= 0.0:  # p == q up to rounding: the residual is empty, p itself is exact
            final = p[accepted]
    return drafts[:accepted] + [int(sample_from_probs(final[None], uniforms[k:].to(p.device)))]
