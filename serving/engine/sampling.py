"""Sampling: logits → processed probabilities → tokens, batched over rows with per-row parameters.

A sampled token is an exponential race (Gumbel-max): token = argmax(p / E) over the vocabulary, E one
Exp(1) draw per token, which picks token x with probability exactly p(x). The draws of output position t of a
request are a pure function of (its seed, t): `position_noise` seeds a generator with both and draws
the vocabulary's E from it, nothing else. So a seeded request's text does not depend on what shares its
batch, on how many tokens a step emits, or on whether speculation ran: the speculator's drafts and its
verification use the same noise (serving/engine/spec/rejection.py; an unseeded request's model drafts are
verified by rejection sampling instead, which accepts more of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.engine.logits import adjust_logits
from serving.engine.types import SamplingParams, TokenLogprobs


@dataclass
class SamplingRows:
    """Per-row sampling parameters for a [N, vocab] logits matrix."""

    temperature: torch.Tensor  # [N] float; rows with 0 are greedy (their value here is 1, see `greedy`)
    top_k: torch.Tensor  # [N] long; vocab size where off
    top_p: torch.Tensor  # [N] float; 1.0 where off
    greedy: torch.Tensor  # [N] bool
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool

    @classmethod
    def from_params(cls, params: list[SamplingParams], vocab_size: int, device: torch.device) -> SamplingRows:
        greedy = [p.greedy for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        return cls(
            temperature=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                                     dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            needs_top_k=any(k < vocab_size for k in top_k),
            needs_top_p=any(p.top_p < 1.0 for p in params),
        )


def apply_top_k_top_p(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Mask logits [N, V] outside each row's top-k and top-p nucleus with -inf."""
    if not (rows.needs_top_k or rows.needs_top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if rows.needs_top_k:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        remove |= ranks[None, :] >= rows.top_k[:, None]
    if rows.needs_top_p:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # keep the smallest prefix whose mass reaches top_p (the most likely token always stays)
        remove |= mass_before >= rows.top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension: the first maximal index on ties, NaN counting as the maximum.

    On CPU through `max(dim).indices`: `argmax` there is a scalar reduction, ~3x slower from a few rows on
    (logits of 4,096 tokens, one thread: 55 against 21 us at 9 rows, 210 against 65 us at 32, 478 against 129 us
    at 64), which was 1-2 % of a 32-64-sequence decode step. Same indices, ties and NaN included (tested)."""
    if logits.device.type == "cpu":
        return logits.max(dim=-1).indices
    return logits.argmax(dim=-1)


def logits_to_probs(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Processed distribution [N, V]: temperature, then top-k, then top-p. Greedy rows become one-hot."""
    probs = apply_top_k_top_p(logits / rows.temperature[:, None], rows).softmax(dim=-1)
    if rows.greedy.any():
        one_hot = torch.zeros_like(probs).scatter_(-1, greedy_tokens(logits)[:, None], 1.0)
        probs = torch.where(rows.greedy[:, None], one_hot, probs)
    return probs


NoiseKey = tuple[int, int]  # (a request's seed, an output position): what a position's draws depend on, alone

_MASK64 = (1 << 64) - 1
_SMALLEST_UNIFORM = 2.0**-25  # below torch.rand's float32 step (2^-24): E stays finite, as p / E must


def position_seed(key: NoiseKey) -> int:
    """A 63-bit generator seed for one output position of one request: splitmix64 over (seed, position), so
    neighbouring seeds and positions give unrelated streams, and every bit of the seed counts (a CPU generator
    keeps only the low 32 bits of what it is seeded with)."""
    seed, position = key
    x = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = ((x ^ (x >> shift)) * mult) & _MASK64
    return (x ^ (x >> 31)) >> 1


def position_noise(keys: list[NoiseKey], vocab_size: int, device: torch.device) -> torch.Tensor:
    """E [N, V]: row i is vocab_size Exp(1) draws, a function of keys[i] alone (one generator reseeded per row;
    on CUDA a CUDA generator, so the draws stay on the device). E = -log(u), u uniform in (0, 1)."""
    generator = torch.Generator(device=device)
    noise = torch.empty(len(keys), vocab_size, device=device)
    for row, key in zip(noise, keys, strict=True):
        generator.manual_seed(position_seed(key))
        torch.rand(vocab_size, generator=generator, device=device, out=row)
    return noise.clamp_(min=_SMALLEST_UNIFORM).log_().neg_()


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row of probs [N, V] from uniforms [N] in (0, 1] (the rejection sampler's
    last draw, spec/rejection.py)."""
    cdf = probs.cumsum(dim=-1)
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, targets).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race: argmax(p / E) per row of probs [N, V], token x winning with probability p(x) (for
    E i.i.d. Exp(1) this is argmax(log p + Gumbel)). Ties need equal p / E ratios: probability 0."""
    return greedy_tokens(probs / noise)


def sample(logits: torch.Tensor, rows: SamplingRows, keys: list[NoiseKey]) -> torch.Tensor:
    """One token per row of fp32 logits [N, V]; keys[i]: row i's (seed, output position)."""
    if rows.all_greedy:
        return greedy_tokens(logits)
    probs = logits_to_probs(logits, rows)
    sampled = race(probs, position_noise(keys, logits.shape[-1], logits.device))
    return torch.where(rows.greedy, greedy_tokens(logits), sampled)


def sample_requests(
    logits: torch.Tensor,
    params: list[SamplingParams],
    keys: list[NoiseKey],
    histories: list[list[int]] | None = None,
) -> torch.Tensor:
    """One token per row for rows with the given parameters; all-greedy batches skip building the rows.

    keys[i]: row i's (seed, output position) (Request.noise_key); histories[i]: the tokens row i generated so far,
    for its penalties (see logits.adjust_logits)."""
    if histories is not None:
        logits = adjust_logits(logits, params, histories)
    if all(p.greedy for p in params):
        return greedy_tokens(logits)
    return sample(logits, SamplingRows.from_params(params, logits.shape[-1], logits.device), keys)


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: list[int]) -> list[TokenLogprobs]:
    """The chosen token's log-probability and the top-n alternatives per row, from raw logits."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
    n_max = max(top_n, default=0)
    top_vals, top_ids = (logprobs.topk(n_max, dim=-1) if n_max else (logprobs[:, :0], tokens[:, None][:, :0]))
    top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(token_id=int(t), logprob=float(c),
                      top_logprobs=list(zip(top_ids_l[i][: top_n[i]], top_vals_l[i][: top_n[i]], strict=True)))
        for i, (t, c) in enumerate(zip(tokens.tolist(), chosen, strict=True))
    ]
