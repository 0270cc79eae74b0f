"""Attention straight from the paged KV cache, without gathering a group's context into a new tensor first.

FlexAttention reads K/V where they lie: the whole layer cache is one long "physical" sequence of slots
([1, Hkv, num_blocks * block_size, D]), and a block-sparse BlockMask lists, for each sequence of the group,
exactly the cache blocks of its block table (`kv_indices` = the table). The mask function maps a physical
slot back to the sequence's logical position (through the inverse of its block table, so blocks shared by
several sequences through prefix caching are right for each) and applies causality. Only the listed blocks
are read, once, by the kernel.

FlexAttention is a compiled kernel (Triton on CUDA, C++ on CPU); its first call per shape compiles. Which
path an engine uses is chosen in `Attention.attend_group`: the gather path stays the default on CPU, where
it measured faster for our step sizes (docs/engine.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from serving.engine.batch import AttentionGroup

# Query rows per FlexAttention query block: decode and verify groups (max_q <= 1 + k) fit in one.
_Q_BLOCK = 128


@functools.cache
def _flex(device_type: str) -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    # CUDA: one kernel for every group count, query length and context (dynamic shapes). CPU: static shapes, one
    # compile per shape — the C++ template fails to build with dynamic shapes in torch 2.13 (measured here)
    return torch.compile(flex_attention, dynamic=device_type == "cuda")


def paged_block_mask(group: AttentionGroup, num_cache_blocks: int, block_size: int) -> Any:
    """The BlockMask of one group over the whole cache: sequence g reads the blocks of its table only."""
    from torch.nn.attention.flex_attention import BlockMask

    assert group.q_start is not None and group.seq_lens is not None
    q_start = group.q_start  # [G] position of each sequence's first query row
    tables = group.block_tables  # [G, B] physical block of each logical block (entries past a context: padding)
    g, b = tables.shape
    device = tables.device
    ctx_blocks = (-(-group.seq_lens // block_size)).to(torch.int32)  # [G] blocks holding the sequence's keys
    # inverse table: physical block -> logical block of sequence g (-1: not one of its blocks); entries past
    # the sequence's context are scattered into a spare last column and dropped
    valid = torch.arange(b, device=device)[None, :] < ctx_blocks[:, None]  # [G, B]
    logical_of = torch.full((g, num_cache_blocks + 1), -1, dtype=torch.long, device=device)
    logical_of.scatter_(1, torch.where(valid, tables, num_cache_blocks), torch.arange(b, device=device).expand(g, b))
    logical_of = logical_of[:, :num_cache_blocks]

    def causal_paged(batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> Any:
        logical_block = logical_of[batch, kv_idx // block_size]
        key_pos = logical_block * block_size + kv_idx % block_size
        return (logical_block >= 0) & (key_pos <= q_start[batch] + q_idx)

    q_blocks = -(-group.max_q // _Q_BLOCK)
    kv_num_blocks = ctx_blocks[:, None, None].expand(g, 1, q_blocks).contiguous()  # [G, 1, QB]
    # the mask spans the whole cache, so its index rows are as wide as the cache; entries past ctx_blocks are unused
    kv_indices = torch.zeros(g, 1, q_blocks, num_cache_blocks, dtype=torch.int32, device=device)
    kv_indices[:, :, :, :b] = tables.to(torch.int32)[:, None, None, :]  # [G, 1, QB, num_cache_blocks]
    # no block is declared "full" (mask-free): every listed block goes through the mask function. The empty
    # full-block arrays are passed anyway: the CPU kernel template does not build without them (torch 2.13)
    no_full = torch.zeros_like(kv_num_blocks), torch.zeros_like(kv_indices)
    return BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, *no_full, BLOCK_SIZE=(_Q_BLOCK, block_size), mask_mod=causal_paged,
        seq_lengths=(group.max_q, num_cache_blocks * block_size), compute_q_blocks=False,  # forward only
    )


def paged_attention(
    q_pad: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, block_mask: Any, scale: float
) -> torch.Tensor:
    """q_pad [G, Hq, max_q, D]; k/v_blocks [num_blocks, block_size, Hkv, D] (one layer) -> [G, Hq, max_q, D]."""
    num_blocks, block_size, hkv, d = k_blocks.shape
    g, hq = q_pad.shape[:2]
    # the cache as one physical sequence, seen by every sequence of the group (a view: nothing is copied)
    k = k_blocks.view(1, num_blocks * block_size, hkv, d).transpose(1, 2).expand(g, hkv, -1, d)
    v = v_blocks.view(1, num_blocks * block_size, hkv, d).transpose(1, 2).expand(g, hkv, -1, d)
    options = None
    if q_pad.device.type == "cuda":
        # the Triton kernel's KV tile must divide the mask's KV block (one cache block): its default tiles
        # (32-128) refuse a 16-token block ("Q and KV block size must be divisible by BLOCK_M and BLOCK_N")
        options = {"BLOCK_N": min(block_size, 64)}
    out: torch.Tensor = _flex(q_pad.device.type)(q_pad, k, v, block_mask=block_mask, scale=scale,
                                                 enable_gqa=hq != hkv, kernel_options=options)
    return out
