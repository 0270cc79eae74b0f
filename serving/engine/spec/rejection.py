"""Verification of draft tokens against the target: lossless speculative sampling.

For draft tokens x_1..x_k proposed from distributions q_1..q_k, with target distributions p_1..p_{k+1}
(the same temperature / top-k / top-p processing applied to both):

    accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), in order, stopping at the first rejection;
    at a rejection at i, emit a sample from normalize(max(0, p_i - q_i)) instead of x_i;
    if all k are accepted, emit a bonus token sampled from p_{k+1}.

The emitted sequence is distributed exactly as sampling from the target token by token. Deterministic
drafts (n-gram lookup, a greedy draft) have a one-hot q.
"""

from __future__ import annotations

import torch

from serving.engine.sampling import sample_from_probs


def verify_greedy(target_argmax: list[int], drafts: list[int]) -> list[int]:
    """Greedy target: keep drafts while they equal the target's argmax, then emit the argmax."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_argmax[accepted]:
        accepted += 1
    return drafts[:accepted] + [target_argmax[accepted]]


def rejection_sample(
    p: torch.Tensor, drafts: list[int], q: torch.Tensor | None, generator: torch.Generator
) -> list[int]:
    """p [k + 1, V] target probs, q [k, V] draft probs (None: one-hot drafts); returns the emitted tokens."""
    k = len(drafts)
    uniforms = 1.0 - torch.rand(k + 1, generator=generator)  # (0, 1]; k acceptance tests + the final draw
    draft_ids = torch.tensor(drafts, dtype=torch.long, device=p.device)
    rows = torch.arange(k, device=p.device)
    p_x = p[rows, draft_ids]
    q_x = q[rows, draft_ids] if q is not None else torch.ones_like(p_x)
    # u <= p(x) / q(x), written without the division (q(x) > 0 for anything the draft proposed)
    accept = uniforms[:k].to(p.device) * q_x <= p_x
    accepted = int(accept.to(torch.int64).cumprod(0).sum()) if k else 0
    if accepted < k:
        if q is not None:
            residual = (p[accepted] - q[accepted]).clamp_(min=0.0)
        else:
            residual = p[accepted].clone()
            residual[drafts[accepted]] = 0.0
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: the residual is empty, p itself is exact
            residual = p[accepted]
        final = sample_from_probs(residual[None], uniforms[k:].to(p.device))
    else:
        final = sample_from_probs(p[k][None], uniforms[k:].to(p.device))
    return drafts[:accepted] + [int(final)]
