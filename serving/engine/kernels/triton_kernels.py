"""Triton kernels for the CUDA decode path: paged decode attention and a fused residual add + RMSNorm.

**Paged decode attention** (flash-decoding over the paged cache). One program per (sequence, KV head, split)
walks its share of the sequence's cache blocks, reading each block's keys and values once for every query row
that needs them: the n_rep query heads of the KV head (GQA) times the sequence's query tokens (1 for decode,
1 + k for verify) are the rows of one tile, so a block costs one load however many heads and drafts read it.
Each row keeps a running maximum and sum (online softmax); a split writes its rows' normalised output and
log-sum-exp, and a second kernel merges the splits. Splitting the context gives batch 1 enough programs to fill
a GPU (8 KV heads alone would use 8 SMs). The merge can also join one key and value that are not in the cache
yet (a decode step captured whole, whose new K/V is stored after the graph): that key is one more "split".

Query token j of a sequence sits at position q_start + j and sees keys 0 … q_start + j of its context
(seq_lens keys in all); padding query rows (past a sequence's own query length) are computed and dropped.

**Residual add + RMSNorm**: h = x + residual in the model dtype, then weight * (h * rsqrt(mean(h²) + eps)) with
the normalisation in fp32, cast to the model dtype before the scale: `model.RMSNorm`'s rounding order.

Every operand is widened to fp32 as it is loaded: a bf16 key or query is exact in tf32, so the dots lose nothing
against bf16 tensor-core dots (fp32 models use IEEE dots, keeping their tokens), and the interpreter, which keeps
bf16 as raw 16-bit integers, computes the same. The kernels are plain `triton.jit` functions, chosen when this
module is imported: with TRITON_INTERPRET=1 they run on CPU tensors under Triton's interpreter, which is how the
tests check them on a machine without a GPU (tests/serving/engine/kernels/test_triton_kernels.py loads a copy of this
module that way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Programs the attention kernel aims for: enough to fill an H100/H200 (132 SMs) about twice.
_TARGET_PROGRAMS = 256
_MAX_SPLITS = 64


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def num_splits(num_seqs: int, n_kv_heads: int, max_blocks: int) -> int:
    """Context splits per (sequence, KV head): a power of two, enough programs to fill the device, never more
    splits than the widest table has blocks."""
    wanted = -(-_TARGET_PROGRAMS // max(num_seqs * n_kv_heads, 1))
    return max(1, min(_next_pow2(wanted), _next_pow2(max(max_blocks, 1)), _MAX_SPLITS))


# Reductions through tl.reduce with our own combine functions, not tl.max / tl.sum: those are `triton.jit`
# functions of Triton's standard library, compiled or interpreted as Triton itself was imported, so a copy of this
# module loaded under the interpreter in a process that imported Triton first could not call them.
@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sum_combine(a, b):
    return a + b


@triton.jit
def _row_max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _max_combine)


@triton.jit
def _row_sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _sum_combine)



@triton.jit
def _paged_attention_split(
    q_ptr, k_ptr, v_ptr, tables_ptr, q_start_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_table,
    scale, blocks_per_split,
    N_KV: tl.constexpr, N_REP: tl.constexpr, MAX_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
):
    g = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)  # row = rep * MAX_Q + query token
    rep = rows // MAX_Q
    qi = rows % MAX_Q
    row_ok = rows < N_REP * MAX_Q
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_start = tl.load(q_start_ptr + g)
    seq_len = tl.load(seq_lens_ptr + g)
    q = tl.load(q_ptr + (g * MAX_Q + qi)[:, None] * stride_qt + (h * N_REP + rep)[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]
    query_pos = q_start + qi  # [BLOCK_M]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    offs = tl.arange(0, BLOCK_SIZE)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE)
    for b in range(first, last):
        block = tl.load(tables_ptr + g * stride_table + b).to(tl.int64)
        k = tl.load(k_ptr + block * stride_kb + offs[:, None] * stride_ks + h * stride_kh + d[None, :],
                    mask=d_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_SIZE, BLOCK_D]
        v = tl.load(v_ptr + block * stride_vb + offs[:, None] * stride_vs + h * stride_vh + d[None, :],
                    mask=d_ok[None, :], other=0.0).to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        key_pos = b * BLOCK_SIZE + offs
        seen = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] < seq_len)
        s = tl.where(seen, s * scale, float("-inf"))  # [BLOCK_M, BLOCK_SIZE]
        m_new = tl.maximum(m_i, _row_max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at zero
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + _row_sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new

    seen_any = l_i > 0
    o = acc / tl.where(seen_any, l_i, 1.0)[:, None]
    lse = tl.where(seen_any, m_i + tl.log(tl.where(seen_any, l_i, 1.0)), float("-inf"))
    part = (g * N_KV + h) * NUM_SPLITS + split  # partials [G, Hkv, NUM_SPLITS, BLOCK_M, BLOCK_D] fp32
    tl.store(o_ptr + part * BLOCK_M * BLOCK_D + rows[:, None] * BLOCK_D + d[None, :], o)
    tl.store(lse_ptr + part * BLOCK_M + rows, lse)


@triton.jit
def _merge_splits(
    o_part_ptr, lse_part_ptr, q_ptr, k_new_ptr, v_new_ptr, out_ptr, stride_qt, stride_qh, stride_kn, stride_vn,
    stride_ot, scale,
    N_KV: tl.constexpr, N_REP: tl.constexpr, MAX_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_NEW: tl.constexpr,
):
    g = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    rep = rows // MAX_Q
    qi = rows % MAX_Q
    row_ok = rows < N_REP * MAX_Q
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    base = (g * N_KV + h) * NUM_SPLITS
    # the rows' largest log-sum-exp first, then the splits' outputs one at a time (a [splits, rows, dims] tile
    # of all of them would not fit in registers at batch 1, where a row has up to 64 splits)
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for split in range(NUM_SPLITS):
        top = tl.maximum(top, tl.load(lse_part_ptr + (base + split) * BLOCK_M + rows))
    if HAS_NEW:  # the row's own key, not in the cache: one more split whose output is its value
        q = tl.load(q_ptr + (g * MAX_Q + qi)[:, None] * stride_qt + (h * N_REP + rep)[:, None] * stride_qh
                    + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        k_new = tl.load(k_new_ptr + g * stride_kn + h * HEAD_DIM + d, mask=d_ok, other=0.0).to(tl.float32)
        v_new = tl.load(v_new_ptr + g * stride_vn + h * HEAD_DIM + d, mask=d_ok, other=0.0).to(tl.float32)
        s_new = _row_sum(q * k_new[None, :], 1) * scale  # [BLOCK_M]
        top = tl.maximum(top, s_new)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    weight = tl.full([BLOCK_M], 0.0, tl.float32)
    for split in range(NUM_SPLITS):
        w = tl.exp(tl.load(lse_part_ptr + (base + split) * BLOCK_M + rows) - top_safe)  # 0: a split that saw nothing
        o = tl.load(o_part_ptr + ((base + split) * BLOCK_M + rows[:, None]) * BLOCK_D + d[None, :])
        total += w[:, None] * o
        weight += w
    if HAS_NEW:
        w_new = tl.exp(s_new - top_safe)
        total += w_new[:, None] * v_new[None, :]
        weight += w_new
    out = total / tl.where(weight > 0, weight, 1.0)[:, None]
    tl.store(out_ptr + (g * MAX_Q + qi)[:, None] * stride_ot + ((h * N_REP + rep) * HEAD_DIM)[:, None] + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _dense_heads(t: torch.Tensor) -> torch.Tensor:
    """[rows, heads, D] with heads D apart and dims adjacent (any row stride), copied only when it is not."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def paged_decode_attention(
    q_pad: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, block_tables: torch.Tensor,
    q_start: torch.Tensor, seq_lens: torch.Tensor, n_rep: int, scale: float,
    k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None, splits: int | None = None,
) -> torch.Tensor:
    """Attention of a decode or verify group read from the paged cache in place (the CPU kernel's signature).

    q_pad [G * max_q, Hq, D] (sequence-major, padded query rows included); k/v_blocks one layer's cache
    [num_blocks, block_size, Hkv, D]; block_tables [G, B]; q_start [G] the first query row's position; seq_lens
    [G] the keys each sequence reads from the cache. k_new/v_new [G, Hkv, D]: a key and value per sequence that
    are not in the cache, seen by every query row (decode captured whole). splits: context splits (default:
    from the group's shape; a captured graph fixes it). Returns [G * max_q, Hq * D] in q's dtype."""
    g, b = block_tables.shape
    num_blocks, block_size, hkv, d = k_blocks.shape
    max_q = q_pad.shape[0] // g
    # q, k_new, v_new are views of the fused qkv projection's rows: read in place where heads and dims are dense
    q_pad = _dense_heads(q_pad)
    has_new = k_new is not None
    k_new = _dense_heads(k_new) if k_new is not None else q_pad  # without a new key: any tensor, never read
    v_new = _dense_heads(v_new) if v_new is not None else q_pad
    block_m = max(16, _next_pow2(n_rep * max_q))
    block_d = max(16, _next_pow2(d))
    splits = splits or num_splits(g, hkv, b)
    per_split = max(-(-b // splits), 1)
    o_part = torch.empty(g, hkv, splits, block_m, block_d, dtype=torch.float32, device=q_pad.device)
    lse_part = torch.empty(g, hkv, splits, block_m, dtype=torch.float32, device=q_pad.device)
    _paged_attention_split[(g, hkv, splits)](
        q_pad, k_blocks, v_blocks, block_tables, q_start, seq_lens, o_part, lse_part,
        q_pad.stride(0), q_pad.stride(1), k_blocks.stride(0), k_blocks.stride(1), k_blocks.stride(2),
        v_blocks.stride(0), v_blocks.stride(1), v_blocks.stride(2), block_tables.stride(0),
        scale, per_split,
        N_KV=hkv, N_REP=n_rep, MAX_Q=max_q, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_SIZE=block_size,
        NUM_SPLITS=splits, IEEE=q_pad.dtype == torch.float32,
    )
    out = torch.empty(g * max_q, hkv * n_rep * d, dtype=q_pad.dtype, device=q_pad.device)
    _merge_splits[(g, hkv)](
        o_part, lse_part, q_pad, k_new, v_new, out, q_pad.stride(0), q_pad.stride(1), k_new.stride(0),
        v_new.stride(0), out.stride(0), scale, N_KV=hkv, N_REP=n_rep, MAX_Q=max_q, HEAD_DIM=d, BLOCK_D=block_d,
        BLOCK_M=block_m, NUM_SPLITS=splits, HAS_NEW=has_new,
    )
    return out


@triton.jit
def _residual_rmsnorm(x_ptr, r_ptr, w_ptr, h_ptr, out_ptr, dim, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=ok, other=0.0)
    r = tl.load(r_ptr + row * dim + cols, mask=ok, other=0.0)
    h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded to the model dtype, as `x + attended`
    tl.store(h_ptr + row * dim + cols, h, mask=ok)
    h32 = h.to(tl.float32)
    normed = h32 * tl.rsqrt(_row_sum(h32 * h32, 0) / dim + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    out = w.to(tl.float32) * normed.to(h.dtype).to(tl.float32)  # cast before the scale: RMSNorm's rounding
    tl.store(out_ptr + row * dim + cols, out.to(h.dtype), mask=ok)


def residual_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual and RMSNorm(h) in one pass: x, residual [T, dim] -> (normed [T, dim], h [T, dim])."""
    x, residual = x.contiguous(), residual.contiguous()
    t, dim = x.shape
    h = torch.empty_like(x)
    out = torch.empty_like(x)
    block = _next_pow2(dim)
    _residual_rmsnorm[(t,)](x, residual, weight, h, out, dim, eps, BLOCK=block, num_warps=min(max(block // 256, 1), 16))
    return out, h


def decode_with_new_key(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
    tables: torch.Tensor, ctx_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """A decode step captured whole: row g's one query q [G, Hq, D] attends the ctx_lens[g] cached keys of its
    table [G, W] and its own new key and value k/v_new [G, Hkv, D] (stored after the graph) -> [G, Hq * D].
    The splits follow the table's width, which is static in a captured graph."""
    n_rep = q.shape[1] // k_new.shape[1]
    return paged_decode_attention(q, k_blocks, v_blocks, tables, ctx_lens, ctx_lens, n_rep, scale, k_new=k_new,
                                  v_new=v_new)
