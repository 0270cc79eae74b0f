"""The flat forward batch: tokens of many sequences in one row, plus the attention layout built once per step.

A step mixes prefill chunks (many tokens), decode tokens (one) and verify tokens (1 + k drafts). Every
layer attends the same way, so the per-sequence bookkeeping (which cache slots to write, which blocks to
read, the causal mask) is turned into tensors here, once, and reused by all layers.

Attention runs per *group*: sequences whose query lengths are alike share one padded SDPA call
(all decodes together; a long prefill chunk alone), keeping padding waste small.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# A sequence joins a group while padding keeps the group's work within this factor of the real work.
_GROUP_PADDING_SLACK = 1.3
# ...and while the group's gathered keys stay small: a group's K/V is gathered and then read right away by
# attention, which is much faster while it still sits in the CPU cache (sequences x context, in tokens).
MAX_GROUP_KEYS = 2048


@dataclass
class SequenceInput:
    token_ids: list[int]  # tokens to run this step (a prefill chunk, one decode token, or last token + drafts)
    start_pos: int  # position of token_ids[0]; the cache already holds positions [0, start_pos)
    block_table: list[int]  # cache blocks of the sequence, covering at least start_pos + len(token_ids)
    logits_offsets: list[int]  # offsets into token_ids whose logits the step needs (may be empty)


@dataclass
class AttentionGroup:
    token_start: int  # the group's tokens are flat rows [token_start, token_end)
    token_end: int
    num_seqs: int  # G
    max_q: int  # longest query of the group; shorter ones are padded
    uniform: bool  # all queries have length max_q: the flat rows reshape to [G, max_q] without a gather
    query_index: torch.Tensor | None  # [G * max_q] flat row of each padded query slot (0 for padding)
    valid_index: torch.Tensor | None  # [num real tokens] positions in the padded [G * max_q] layout
    block_tables: torch.Tensor  # [G, max_blocks] cache blocks to read (padding blocks are masked out)
    key_len: int  # keys read per sequence: the group's longest context
    query_pos: torch.Tensor | None  # [G, max_q] (host) each query row's position, for `mask`; None = no mask needed
    q_start: torch.Tensor | None = None  # [G] position of each sequence's first query row (the paged path's mask)
    seq_lens: torch.Tensor | None = None  # [G] context length of each sequence after this step (ditto)
    block_mask: Any = None  # the paged path's FlexAttention BlockMask: built by the first layer, shared by all
    mask_maker: Callable[[torch.Tensor, int], torch.Tensor] | None = field(default=None, repr=False)
    _mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def mask(self) -> torch.Tensor | None:
        """[G, 1, n_rep * max_q, key_len] additive (0 or -inf) causal mask of the gather path's SDPA; None = attend
        to all. Made on first use and shared by every layer: the paged path never asks, so its steps never pay
        for building it or copying it to the device."""
        if self._mask is None and self.query_pos is not None:
            assert self.mask_maker is not None
            self._mask = self.mask_maker(self.query_pos, self.key_len)
        return self._mask


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) each token's K/V goes to
    groups: list[AttentionGroup]
    logits_index: torch.Tensor  # [N] flat rows whose logits are computed, in request order

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def group_sequences(q_lens: list[int], ctx_lens: list[int], in_place_max_q: int = 0) -> list[list[int]]:
    """Partition sequence indices into attention groups, longest queries first.

    Sequences whose queries are at most in_place_max_q tokens are read in place from the cache by the CPU attention
    kernel, which walks each sequence over its own context and its own query tokens: padding costs it nothing, so
    they make one group whatever their lengths (at 64 decoding sequences the gather path's key cap cut one kernel
    call per layer into ten, and query padding put decoding sequences beside verifying ones into a second call
    and made them score their padding rows). Other groups are capped by query padding and gathered keys."""
    order = sorted(range(len(q_lens)), key=lambda i: (-q_lens[i], -ctx_lens[i]))
    groups: list[list[int]] = []
    current: list[int] = []
    real = padded_q = padded_ctx = 0
    for i in order:
        if current:
            if padded_q <= in_place_max_q:
                current.append(i)
                continue
            # queries are sorted longest first, so max_q stays; the context may grow
            new_real = real + q_lens[i] * ctx_lens[i]
            new_keys = (len(current) + 1) * max(padded_ctx, ctx_lens[i])
            if new_keys * padded_q <= _GROUP_PADDING_SLACK * new_real + 64 * padded_q and new_keys <= MAX_GROUP_KEYS:
                current.append(i)
                real, padded_ctx = new_real, max(padded_ctx, ctx_lens[i])
                continue
            groups.append(current)
        current, real, padded_q, padded_ctx = [i], q_lens[i] * ctx_lens[i], q_lens[i], ctx_lens[i]
    if current:
        groups.append(current)
    return groups


class ForwardBatchBuilder:
    """Builds a step's ForwardBatch with per-sequence (never per-token) Python and a handful of tensor ops.

    Kept for the life of an engine: the index ramps every step needs (token offsets, key positions) are made
    once and sliced, instead of a new arange per group per step."""

    def __init__(self, block_size: int, n_rep: int, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.block_size, self.n_rep, self.device, self.dtype = block_size, n_rep, device, dtype
        self._ramp = torch.arange(0)  # 0, 1, 2, ... on the CPU, grown on demand
        # queries up to this long attend in place (the model's CPU attention kernel; 0: every group gathers),
        # which lifts the gather path's cap on a group's keys (group_sequences)
        self.in_place_max_q = 0

    def ramp(self, n: int) -> torch.Tensor:
        if n > self._ramp.shape[0]:
            self._ramp = torch.arange(max(n, 2 * self._ramp.shape[0], 1024), dtype=torch.long)
        return self._ramp[:n]

    def build(self, seqs: list[SequenceInput]) -> ForwardBatch:
        """Lay the sequences out group by group and precompute slots, block tables and masks."""
        bs = self.block_size
        q_lens = [len(s.token_ids) for s in seqs]
        ctx_lens = [s.start_pos + q for s, q in zip(seqs, q_lens, strict=True)]
        grouping = group_sequences(q_lens, ctx_lens, self.in_place_max_q)
        order = [i for members in grouping for i in members]  # sequences in flat-row order

        # per sequence, in flat order: query length, first position, first flat row, padded block table
        q_t = torch.tensor([q_lens[i] for i in order], dtype=torch.long)  # [S]
        start_t = torch.tensor([seqs[i].start_pos for i in order], dtype=torch.long)  # [S]
        row_t = q_t.cumsum(0) - q_t  # [S]
        max_blocks = -(-max(ctx_lens) // bs)
        tables = torch.tensor([_padded(seqs[i].block_table, -(-ctx_lens[i] // bs), max_blocks) for i in order],
                              dtype=torch.long)  # [S, max_blocks]

        num_tokens = sum(q_lens)
        if num_tokens == len(seqs):  # decode only: one token per sequence, so a per-sequence list is cheapest
            starts = [seqs[i].start_pos for i in order]
            positions = torch.tensor(starts, dtype=torch.long)
            slot_list = [seqs[i].block_table[p // bs] * bs + p % bs for i, p in zip(order, starts, strict=True)]
            slots = torch.tensor(slot_list, dtype=torch.long)
        else:  # every token's position and slot from per-sequence tensors, no per-token Python
            seq_of_row = torch.repeat_interleave(self.ramp(len(seqs)), q_t)  # [T]
            positions = start_t[seq_of_row] + self.ramp(num_tokens) - row_t[seq_of_row]
            slots = tables[seq_of_row].gather(1, (positions // bs)[:, None]).squeeze(1) * bs + positions % bs

        row_of = [0] * len(seqs)  # first flat row of each sequence, by request index
        groups: list[AttentionGroup] = []
        first = row = 0
        for members in grouping:
            token_start = row
            for i in members:
                row_of[i] = row
                row += q_lens[i]
            groups.append(self._group(members, first, q_lens, ctx_lens, token_start, row, q_t, start_t, row_t,
                                      tables))
            first += len(members)

        flat_ids = [t for i in order for t in seqs[i].token_ids]
        logits_rows = [row_of[i] + off for i, s in enumerate(seqs) for off in s.logits_offsets]
        batch = ForwardBatch(
            input_ids=torch.tensor(flat_ids, dtype=torch.long),
            positions=positions,
            slot_mapping=slots,
            groups=groups,
            logits_index=torch.tensor(logits_rows, dtype=torch.long),
        )
        if self.device.type != "cpu":
            self._upload(batch)
        return batch

    def _upload(self, batch: ForwardBatch) -> None:
        """Move the batch's index tensors to the device in one copy from pinned memory, without waiting for it.

        One blocking copy per tensor would cost the host a copy and a device synchronisation each (seven or
        more per step); the copy is queued on the step's stream ahead of the forward that reads it, and the
        pinned buffer is not reused before the copy has run (the caching host allocator records its use)."""
        move_index_tensors(batch, lambda flat: flat.pin_memory().to(self.device, non_blocking=True))

    def _causal_mask(self, query_pos: torch.Tensor, key_len: int) -> torch.Tensor:
        """The additive causal mask of a group: query row i of sequence g sees keys [0, query_pos[g, i]]."""
        num, max_q = query_pos.shape
        allowed = self.ramp(key_len)[None, None, :] <= query_pos[:, :, None]  # [G, max_q, K]
        # SDPA would turn a bool mask into an additive one in every layer; do it once here
        additive = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, float("-inf"))
        mask = additive[:, None, None].expand(num, 1, self.n_rep, max_q, key_len)
        return mask.reshape(num, 1, self.n_rep * max_q, key_len).to(self.device)

    def _group(
        self,
        members: list[int],
        first: int,
        q_lens: list[int],
        ctx_lens: list[int],
        token_start: int,
        token_end: int,
        q_t: torch.Tensor,
        start_t: torch.Tensor,
        row_t: torch.Tensor,
        tables: torch.Tensor,
    ) -> AttentionGroup:
        """members: request indices; they are sequences [first, first + G) of the flat-order tensors."""
        num = len(members)
        sl = slice(first, first + num)
        max_q = max(q_lens[i] for i in members)
        key_len = max(ctx_lens[i] for i in members)
        uniform = all(q_lens[i] == max_q for i in members)
        offsets = self.ramp(max_q)
        valid = None if uniform else offsets[None, :] < q_t[sl, None]  # [G, max_q]

        q_pos = None
        if not (num == 1 and max_q == 1):  # a lone decode token sees its whole context: no mask needed
            # padded query slots get position 0 so their mask row is never empty (no NaN); their output is dropped
            q_pos = start_t[sl, None] + offsets[None, :]  # [G, max_q]
            if valid is not None:
                q_pos = torch.where(valid, q_pos, 0)

        query_index = valid_index = None
        if valid is not None:
            query_index = torch.where(valid, row_t[sl, None] + offsets[None, :], 0).reshape(-1)
            valid_index = valid.reshape(-1).nonzero().squeeze(1)
        return AttentionGroup(
            token_start=token_start,
            token_end=token_end,
            num_seqs=num,
            max_q=max_q,
            uniform=uniform,
            query_index=query_index,
            valid_index=valid_index,
            block_tables=tables[sl, : -(-key_len // self.block_size)],
            key_len=key_len,
            query_pos=q_pos,
            q_start=start_t[sl],
            seq_lens=start_t[sl] + q_t[sl],
            mask_maker=self._causal_mask,
        )


def move_index_tensors(batch: ForwardBatch, move: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace every index tensor of a batch (ids, positions, slots, logits rows, and each group's tables, starts,
    lengths and query/valid indices) by a view of one flat tensor, moved by a single call of `move`."""
    fields: list[tuple[Any, str]] = [(batch, "input_ids"), (batch, "positions"), (batch, "slot_mapping"),
                                     (batch, "logits_index")]
    for group in batch.groups:
        fields += [(group, name) for name in ("block_tables", "q_start", "seq_lens", "query_index", "valid_index")
                   if getattr(group, name) is not None]
    host = [getattr(obj, name) for obj, name in fields]
    flat = move(torch.cat([t.reshape(-1) for t in host]))
    start = 0
    for (obj, name), t in zip(fields, host, strict=True):
        setattr(obj, name, flat[start : start + t.numel()].view(t.shape))
        start += t.numel()


def _padded(table: list[int], num_blocks: int, width: int) -> list[int]:
    """The first num_blocks entries of a block table, padded with block 0 to width (padding is masked out)."""
    return table[:num_blocks] + [0] * (width - num_blocks)


def build_forward_batch(
    seqs: list[SequenceInput], block_size: int, n_rep: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> ForwardBatch:
    """One-off build (a builder kept across steps reuses its index ramps; see ForwardBatchBuilder)."""
    return ForwardBatchBuilder(block_size, n_rep, device, dtype).build(seqs)
