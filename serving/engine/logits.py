"""Per-request logit adjustments, applied to a batch's logits before sampling and before verifying drafts.

    presence / frequency penalty (OpenAI's definition), over the tokens the request generated so far:
        logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)
    logit_bias: logit[t] += bias[t]

Plain sampling and speculative verification call the same function, each row with the tokens generated
before it (a verify row at draft position j counts the drafts before j), so the rejection sampler sees
exactly the distribution plain sampling would: speculation stays lossless. Logprobs stay those of the raw
logits, as OpenAI reports them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serving.engine.types import SamplingParams


def adjust_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[Sequence[int]]
) -> torch.Tensor:
    """logits [N, V] fp32; params[i] and histories[i] (the tokens generated before row i) belong to row i.

    Returns logits itself when no row adjusts anything, else a new tensor (the input is never modified)."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    out = logits.clone()
    penalized = [i for i in rows if params[i].presence_penalty or params[i].frequency_penalty]
    if penalized:
        counts = torch.zeros(len(penalized), vocab, dtype=logits.dtype, device=device)  # [P, V]
        for r, i in enumerate(penalized):
            if histories[i]:
                ids = torch.tensor(histories[i], dtype=torch.long, device=device)
                counts[r].scatter_add_(0, ids, torch.ones(ids.shape[0], dtype=logits.dtype, device=device))
        freq = torch.tensor([params[i].frequency_penalty for i in penalized], dtype=logits.dtype, device=device)
        presence = torch.tensor([params[i].presence_penalty for i in penalized], dtype=logits.dtype, device=device)
        index = torch.tensor(penalized, dtype=torch.long, device=device)
        out[index] -= freq[:, None] * counts + presence[:, None] * (counts > 0).to(logits.dtype)
    biased = [(i, t, b) for i in rows for t, b in params[i].logit_bias.items() if t < vocab]
    if biased:
        row_ids = torch.tensor([i for i, _, _ in biased], dtype=torch.long, device=device)
        token_ids = torch.tensor([t for _, t, _ in biased], dtype=torch.long, device=device)
        out.index_put_((row_ids, token_ids), torch.tensor([b for _, _, b in biased], dtype=logits.dtype,
                                                          device=device), accumulate=True)
    return out
