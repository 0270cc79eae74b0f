"""Rotary position embeddings: inverse frequencies for the rope types a Llama-family config.json names.

Matches transformers' `modeling_rope_utils` for default, linear, llama3 and yarn. "dynamic" (NTK) depends
on the current sequence length in transformers, which a KV cache written at earlier lengths cannot follow;
here the frequencies are fixed for the engine's max_model_len: identical to transformers while
max_model_len <= the original max_position_embeddings, NTK-scaled for max_model_len beyond it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def compute_inv_freq(
    head_dim: int, params: dict[str, Any], max_position_embeddings: int, max_model_len: int
) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim // 2] fp32, attention_scaling applied to cos/sin)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = float(params.get("rope_theta", 10000.0))
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if dim != head_dim:
        raise ValueError("partial_rotary_factor < 1 is not supported")
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "dynamic":
        factor = float(params["factor"])
        original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
        if max_model_len <= original:
            return inv_freq, 1.0
        base = base * ((factor * max_model_len / original) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, base, params, max_position_embeddings)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = int(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are interpolated by factor, short ones kept, the band between blended smoothly
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    dim: int, base: float, params: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)


def build_rope_cache(
    inv_freq: torch.Tensor, attention_scaling: float, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables [max_len, head_dim] in fp32.

    transformers rotates as x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1). Folding the
    minus sign into the first half of sin turns that into x * cos + roll(x) * sin_signed: the same products
    bit for bit, in three ops instead of six.
    """
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [max_len, head_dim // 2]
    sin = freqs.sin() * attention_scaling
    return torch.cat((freqs, freqs), dim=-1).cos() * attention_scaling, torch.cat((-sin, sin), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, n_heads, head_dim]; cos/sin_signed [num_tokens, 1, head_dim] in x's dtype."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)
