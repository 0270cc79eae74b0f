"""Attention straight from the paged KV cache, without gathering a group's context into a new tensor first.

FlexAttention reads K/V where they lie: the whole layer cache is one long "physical" sequence of slots
([1, Hkv, num_blocks * block_size, D]), and a block-sparse BlockMask lists, for each sequence of the group,
exactly the cache blocks of its block table (`kv_indices` = the table). The mask function maps a physical
slot back to the sequence's logical position (through the inverse of its block table, so blocks shared by
several sequences through prefix caching are right for each) and applies causality. Only the listed blocks
are read, once, by the kernel.

FlexAttention is a compiled kernel (Triton on CUDA, C++ on CPU); its first call per shape compiles. Which
path an engine uses is chosen in `Attention.attend_group`: the gather path stays the default on CPU, where
it measured faster for our step sizes (docs/benchmarks/log.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from serving.engine.batch import AttentionGroup

# Query rows per FlexAttention query block: decode and verify groups (max_q <= 1 + k) fit in one.
_Q_BLOCK = 128


@functools.cache
def _flex(device_type: str) -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    # CUDA: one kernel for every group count, query length and context (dynamic shapes). CPU: static shapes, one
    # compile per shape — the C++ template fails to build with dynamic shapes in torch 2.13 (measured here)
    return torch.compile(flex_attention, dynamic=device_type == "cuda")


def _inverse_tables(tables: torch.Tensor, ctx_blocks: torch.Tensor, num_cache_blocks: int) -> torch.Tensor:
    """[G, B] block tables -> [G, num_cache_blocks]: the logical block of each physical block in sequence g's
    table (-1: not one of its first ctx_blocks[g] blocks). Entries past a context are scattered into a spare
    last column and dropped. Tensor ops only, so it traces into a compiled graph."""
    g, b = tables.shape
    device = tables.device
    valid = torch.arange(b, device=device)[None, :] < ctx_blocks[:, None]  # [G, B]
    logical_of = torch.full((g, num_cache_blocks + 1), -1, dtype=torch.long, device=device)
    logical_of.scatter_(1, torch.where(valid, tables.long(), num_cache_blocks),
                        torch.arange(b, device=device).expand(g, b))
    return logical_of[:, :num_cache_blocks]


def _block_mask_over_cache(tables: torch.Tensor, ctx_blocks: torch.Tensor, num_cache_blocks: int, block_size: int,
                           max_q: int, mask_mod: Callable[..., Any]) -> Any:
    """A BlockMask over the whole cache as one physical sequence: sequence g lists its first ctx_blocks[g] table
    entries; every listed block goes through mask_mod. mask_mod must be exact by itself: FlexAttention's eager
    path evaluates it on every (query, key) pair and ignores the block lists."""
    from torch.nn.attention.flex_attention import BlockMask

    g = tables.shape[0]
    q_blocks = -(-max_q // _Q_BLOCK)
    kv_num_blocks = ctx_blocks.to(torch.int32)[:, None, None].expand(g, 1, q_blocks).contiguous()  # [G, 1, QB]
    # the mask spans the whole cache, so its index rows are as wide as the cache; entries past ctx_blocks are unused
    kv_indices = F.pad(tables.to(torch.int32), (0, num_cache_blocks - tables.shape[1]))  # [G, num_cache_blocks]
    kv_indices = kv_indices[:, None, None, :].expand(g, 1, q_blocks, num_cache_blocks).contiguous()
    # no block is declared "full" (mask-free): every listed block goes through the mask function. On CPU the
    # empty full-block arrays are passed anyway: the C++ kernel template does not build without them (torch 2.13).
    # On CUDA they are left out: with them, the Triton decode kernel splits the work by the length of the whole
    # cache instead of by the listed blocks, and one program per KV head then walks every block of the context
    on_cpu = tables.device.type == "cpu"
    return BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, full_kv_num_blocks=torch.zeros_like(kv_num_blocks) if on_cpu else None,
        full_kv_indices=torch.zeros_like(kv_indices) if on_cpu else None, BLOCK_SIZE=(_Q_BLOCK, block_size),
        mask_mod=mask_mod, seq_lengths=(max_q, num_cache_blocks * block_size), compute_q_blocks=False,  # forward only
    )


def _causal_block_mask(tables: torch.Tensor, q_start: torch.Tensor, key_lens: torch.Tensor, num_cache_blocks: int,
                       block_size: int, max_q: int) -> Any:
    """Sequence g reads the first key_lens[g] keys of its block table [G, B], query row i up to position
    q_start[g] + i: the mask function maps a physical slot back to its logical position through the inverse
    of the table (blocks shared through prefix caching are right for each sequence). Traces into a graph."""
    ctx_blocks = (key_lens + block_size - 1) // block_size  # [G] blocks holding the sequence's keys
    logical_of = _inverse_tables(tables, ctx_blocks, num_cache_blocks)

    def causal_paged(batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> Any:
        logical_block = logical_of[batch, kv_idx // block_size]
        key_pos = logical_block * block_size + kv_idx % block_size
        return (logical_block >= 0) & (key_pos <= q_start[batch] + q_idx)

    return _block_mask_over_cache(tables, ctx_blocks, num_cache_blocks, block_size, max_q, causal_paged)


def paged_block_mask(group: AttentionGroup, num_cache_blocks: int, block_size: int) -> Any:
    """The BlockMask of one group over the whole cache: sequence g reads the blocks of its table only."""
    assert group.q_start is not None and group.seq_lens is not None
    return _causal_block_mask(group.block_tables, group.q_start, group.seq_lens, num_cache_blocks, block_size,
                              group.max_q)


def context_block_mask(tables: torch.Tensor, ctx_lens: torch.Tensor, num_cache_blocks: int, block_size: int) -> Any:
    """The BlockMask of a decode step whose new tokens are not in the cache yet: row g (one query) sees the
    ctx_lens[g] cached keys before it, read in place through its block table [G, W]."""
    return _causal_block_mask(tables, ctx_lens - 1, ctx_lens, num_cache_blocks, block_size, 1)


def _kernel_options(device: torch.device, block_size: int) -> Any:
    if device.type != "cuda":
        return None
    # the Triton kernel's KV tile must divide the mask's KV block (one cache block): its default tiles
    # (32-128) refuse a 16-token block ("Q and KV block size must be divisible by BLOCK_M and BLOCK_N")
    return {"BLOCK_N": min(block_size, 64)}


def _cache_as_sequence(blocks: torch.Tensor, g: int) -> torch.Tensor:
    """[num_blocks, block_size, Hkv, D] -> [g, Hkv, num_blocks * block_size, D]: a view, nothing is copied."""
    num_blocks, block_size, hkv, d = blocks.shape
    return blocks.view(1, num_blocks * block_size, hkv, d).transpose(1, 2).expand(g, hkv, -1, d)


def attend_context_and_self(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
    block_mask: Any, scale: float,
) -> torch.Tensor:
    """One query per row, attending its cached context (in place, through block_mask) and its own new key.

    q [G, Hq, D]; k_new/v_new [G, Hkv, D] (not in the cache yet); k/v_blocks one layer's cache -> [G, Hq * D].
    The context part comes from FlexAttention with its log-sum-exp; the new key's score joins it by the
    usual softmax merge, so the result equals attention over context + self without writing the cache first
    (a captured graph then reads the cache only, and the step writes the new K/V after it)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    g, hq, d = q.shape
    hkv = k_new.shape[1]
    rep = hq // hkv
    o_ctx, aux = flex_attention(
        q[:, :, None, :], _cache_as_sequence(k_blocks, g), _cache_as_sequence(v_blocks, g), block_mask=block_mask,
        scale=scale, enable_gqa=hq != hkv, return_aux=AuxRequest(lse=True),
        kernel_options=_kernel_options(q.device, k_blocks.shape[1]),
    )
    assert aux.lse is not None
    lse_ctx = aux.lse.view(g, hq).float()  # -inf (or very negative) for a row with no context
    q32 = q.float().view(g, hkv, rep, d)
    s_self = (q32 * k_new.float()[:, :, None, :]).sum(-1).view(g, hq) * scale
    top = torch.maximum(lse_ctx, s_self)
    w_ctx = torch.exp(lse_ctx - top)[..., None]  # [G, Hq, 1]
    w_self = torch.exp(s_self - top)[..., None]
    v_self = v_new.float()[:, :, None, :].expand(g, hkv, rep, d).reshape(g, hq, d)
    # a row without context has w_ctx 0: its (undefined) context output must not leak in as NaN
    o = torch.where(w_ctx > 0, o_ctx.view(g, hq, d).float() * w_ctx, 0.0) + v_self * w_self
    return (o / (w_ctx + w_self)).to(q.dtype).reshape(g, hq * d)


def paged_attention(
    q_pad: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, block_mask: Any, scale: float
) -> torch.Tensor:
    """q_pad [G, Hq, max_q, D]; k/v_blocks [num_blocks, block_size, Hkv, D] (one layer) -> [G, Hq, max_q, D]."""
    g, hq = q_pad.shape[:2]
    hkv = k_blocks.shape[2]
    # the cache as one physical sequence, seen by every sequence of the group
    k, v = _cache_as_sequence(k_blocks, g), _cache_as_sequence(v_blocks, g)
    out: torch.Tensor = _flex(q_pad.device.type)(q_pad, k, v, block_mask=block_mask, scale=scale,
                                                 enable_gqa=hq != hkv,
                                                 kernel_options=_kernel_options(q_pad.device, k_blocks.shape[1]))
    return out


class CapturedDecode:
    """A decode step run as one captured graph (serving.engine.compile): every layer attends its cached context
    in place and its new token beside it, and hands back the new K/V, which the step writes after the graph.

    Reading the cache and writing it outside keeps the graph free of side effects: the cache is a static input
    the graph never mutates, and padding rows of a bucket (copies of row 0) write nothing. Each layer's cache
    enters the graph as its own view: indexing one [L, ...] tensor inside the graph made inductor use 64-bit
    indexing once the whole cache passed 2^31 elements, which FlexAttention's Triton template fails to build
    (torch 2.11, found on an H200 with a 311k-block cache)."""

    def __init__(self, k_layers: list[torch.Tensor], v_layers: list[torch.Tensor], tables: torch.Tensor,
                 ctx_lens: torch.Tensor, scale: float, kernel: Callable[..., torch.Tensor] | None = None) -> None:
        self.k_layers, self.v_layers = k_layers, v_layers  # per layer [num_blocks, block_size, Hkv, D]
        num_blocks, block_size = k_layers[0].shape[0], k_layers[0].shape[1]
        # kernel: (q, k_new, v_new, k_blocks, v_blocks, tables, ctx_lens, scale) -> [G, Hq * D] reading the table
        # itself (serving.engine.kernels.gpu_kernels), in place of FlexAttention and its block mask
        self.kernel, self.tables, self.ctx_lens = kernel, tables, ctx_lens
        self.block_mask = None if kernel else context_block_mask(tables, ctx_lens, num_blocks, block_size)
        self.scale = scale
        self.new_k: list[torch.Tensor] = []  # per layer [G, Hkv, D]
        self.new_v: list[torch.Tensor] = []

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """q [G, Hq, D], k/v [G, Hkv, D] of this layer's new tokens -> [G, Hq * D]."""
        self.new_k.append(k)
        self.new_v.append(v)
        if self.kernel is not None:
            return self.kernel(q, k, v, self.k_layers[layer], self.v_layers[layer], self.tables, self.ctx_lens,
                               self.scale)
        return attend_context_and_self(q, k, v, self.k_layers[layer], self.v_layers[layer], self.block_mask,
                                       self.scale)
