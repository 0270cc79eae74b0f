"""The flat forward batch: tokens of many sequences in one row, plus the attention layout built once per step.

A step mixes prefill chunks (many tokens), decode tokens (one) and verify tokens (1 + k drafts). Every
layer attends the same way, so the per-sequence bookkeeping (which cache slots to write, which blocks to
read, the causal mask) is turned into tensors here, once, and reused by all layers.

Attention runs per *group*: sequences whose query lengths are alike share one padded SDPA call
(all decodes together; a long prefill chunk alone), keeping padding waste small.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    mask: torch.Tensor | None  # [G, 1, n_rep * max_q, key_len] additive (0 or -inf); None = attend to all


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


def group_sequences(q_lens: list[int], ctx_lens: list[int]) -> list[list[int]]:
    """Partition sequence indices into attention groups, longest queries first."""
    order = sorted(range(len(q_lens)), key=lambda i: (-q_lens[i], -ctx_lens[i]))
    groups: list[list[int]] = []
    current: list[int] = []
    real = padded_q = padded_ctx = 0
    for i in order:
        if current:
            new_real = real + q_lens[i] * ctx_lens[i]
            # queries are sorted longest first, so max_q stays; the context may grow
            new_keys = (len(current) + 1) * max(padded_ctx, ctx_lens[i])
            new_padded = new_keys * padded_q
            if new_padded <= _GROUP_PADDING_SLACK * new_real + 64 * padded_q and new_keys <= MAX_GROUP_KEYS:
                current.append(i)
                real, padded_ctx = new_real, max(padded_ctx, ctx_lens[i])
                continue
            groups.append(current)
        current, real, padded_q, padded_ctx = [i], q_lens[i] * ctx_lens[i], q_lens[i], ctx_lens[i]
    if current:
        groups.append(current)
    return groups


def build_forward_batch(
    seqs: list[SequenceInput], block_size: int, n_rep: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> ForwardBatch:
    """Lay the sequences out group by group and precompute slots, block tables and masks."""
    q_lens = [len(s.token_ids) for s in seqs]
    ctx_lens = [s.start_pos + q for s, q in zip(seqs, q_lens, strict=True)]
    grouping = group_sequences(q_lens, ctx_lens)

    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    row_of: list[int] = [0] * len(seqs)  # first flat row of each sequence
    groups: list[AttentionGroup] = []
    for members in grouping:
        token_start = len(input_ids)
        for i in members:
            s = seqs[i]
            row_of[i] = len(input_ids)
            input_ids.extend(s.token_ids)
            pos = range(s.start_pos, s.start_pos + len(s.token_ids))
            positions.extend(pos)
            table = s.block_table
            slots.extend(table[p // block_size] * block_size + p % block_size for p in pos)
        groups.append(
            _build_group(seqs, members, q_lens, ctx_lens, token_start, len(input_ids), block_size, n_rep,
                         device, dtype)
        )

    logits_rows = [row_of[i] + off for i, s in enumerate(seqs) for off in s.logits_offsets]
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        groups=groups,
        logits_index=torch.tensor(logits_rows, dtype=torch.long, device=device),
    )


def _build_group(
    seqs: list[SequenceInput],
    members: list[int],
    q_lens: list[int],
    ctx_lens: list[int],
    token_start: int,
    token_end: int,
    block_size: int,
    n_rep: int,
    device: torch.device,
    dtype: torch.dtype,
) -> AttentionGroup:
    num = len(members)
    max_q = max(q_lens[i] for i in members)
    key_len = max(ctx_lens[i] for i in members)
    max_blocks = -(-key_len // block_size)
    tables = [seqs[i].block_table[:max_blocks] for i in members]
    tables = [t + [0] * (max_blocks - len(t)) for t in tables]
    uniform = all(q_lens[i] == max_q for i in members)

    offsets = torch.arange(max_q, dtype=torch.long)
    valid = offsets[None, :] < torch.tensor([q_lens[i] for i in members])[:, None]  # [G, max_q]
    mask = None
    if not (num == 1 and max_q == 1):  # a lone decode token sees its whole context: no mask needed
        start_t = torch.tensor([seqs[i].start_pos for i in members], dtype=torch.long)
        # padded query slots get position 0 so their mask row is never empty (no NaN); their output is dropped
        q_pos = torch.where(valid, start_t[:, None] + offsets[None, :], 0)  # [G, max_q]
        allowed = torch.arange(key_len)[None, None, :] <= q_pos[:, :, None]  # [G, max_q, K]: causal
        # SDPA would turn a bool mask into an additive one in every layer; do it once here
        additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
        mask = additive[:, None, None].expand(num, 1, n_rep, max_q, key_len)
        mask = mask.reshape(num, 1, n_rep * max_q, key_len).to(device)

    query_index = valid_index = None
    if not uniform:
        row_starts = torch.tensor([0] + [q_lens[i] for i in members[:-1]], dtype=torch.long).cumsum(0) + token_start
        query_index = torch.where(valid, row_starts[:, None] + offsets[None, :], 0).reshape(-1).to(device)
        valid_index = valid.reshape(-1).nonzero().squeeze(1).to(device)
    return AttentionGroup(
        token_start=token_start,
        token_end=token_end,
        num_seqs=num,
        max_q=max_q,
        uniform=uniform,
        query_index=query_index,
        valid_index=valid_index,
        block_tables=torch.tensor(tables, dtype=torch.long, device=device),
        key_len=key_len,
        mask=mask,
    )
