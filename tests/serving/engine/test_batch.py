from __future__ import annotations

import torch

from serving.engine.batch import (
    MAX_GROUP_KEYS,
    ForwardBatchBuilder,
    SequenceInput,
    build_forward_batch,
    group_sequences,
)

CPU = torch.device("cpu")


def test_positions_slots_and_logits_rows_of_a_mixed_step() -> None:
    seqs = [
        SequenceInput([7], start_pos=5, block_table=[3, 9], logits_offsets=[0]),  # decode at position 5
        SequenceInput([1, 2, 3], start_pos=3, block_table=[4, 8], logits_offsets=[2]),  # chunk crossing a block
        SequenceInput([4, 5], start_pos=0, block_table=[6], logits_offsets=[]),  # partial prefill, no logits
    ]
    batch = build_forward_batch(seqs, block_size=4, n_rep=1, device=CPU)
    rows = {}  # flat rows of each sequence, read back from the layout the builder chose
    for i, s in enumerate(seqs):
        for r in range(batch.num_tokens):
            if batch.input_ids[r : r + len(s.token_ids)].tolist() == s.token_ids:
                rows[i] = r
                break
    assert len(rows) == 3
    expected_slots = {0: [9 * 4 + 1], 1: [4 * 4 + 3, 8 * 4 + 0, 8 * 4 + 1], 2: [6 * 4 + 0, 6 * 4 + 1]}
    expected_pos = {0: [5], 1: [3, 4, 5], 2: [0, 1]}
    for i, r in rows.items():
        n = len(seqs[i].token_ids)
        assert batch.positions[r : r + n].tolist() == expected_pos[i]
        assert batch.slot_mapping[r : r + n].tolist() == expected_slots[i]
    assert batch.logits_index.tolist() == [rows[0], rows[1] + 2]


def test_group_masks_are_causal_per_sequence_and_padding_is_dropped() -> None:
    seqs = [SequenceInput([1, 2], start_pos=2, block_table=[0], logits_offsets=[1]),
            SequenceInput([3], start_pos=1, block_table=[1], logits_offsets=[0])]
    builder = ForwardBatchBuilder(block_size=4, n_rep=2, device=CPU)
    batch = builder.build(seqs)
    group = next(g for g in batch.groups if g.num_seqs == 2)  # alike enough to share one padded call
    assert group.max_q == 2 and group.key_len == 4 and not group.uniform
    assert group.mask is not None and group.mask.shape == (2, 1, 2 * 2, 4)
    allowed = group.mask == 0
    # sequence 0: queries at positions 2 and 3 (each repeated for both query heads of a KV head)
    assert allowed[0, 0].tolist() == [[True, True, True, False], [True, True, True, True]] * 2
    # sequence 1: one query at position 1, then a padded slot that sees position 0 only
    assert allowed[1, 0].tolist() == [[True, True, False, False], [True, False, False, False]] * 2
    assert group.valid_index is not None and group.valid_index.tolist() == [0, 1, 2]
    assert group.block_tables.tolist() == [[0], [1]]
    # the builder's index ramps are kept and reused across steps
    ramp = builder.ramp(8)
    assert builder.build(seqs).positions.tolist() == batch.positions.tolist()
    assert builder.ramp(8).data_ptr() == ramp.data_ptr()


def test_decode_only_step_is_one_row_per_sequence() -> None:
    seqs = [SequenceInput([i], start_pos=16 * i + 3, block_table=list(range(10 * i, 10 * i + 4)), logits_offsets=[0])
            for i in range(3)]
    batch = build_forward_batch(seqs, block_size=16, n_rep=1, device=CPU)
    by_token = dict(zip(batch.input_ids.tolist(), zip(batch.positions.tolist(), batch.slot_mapping.tolist(),
                                                      strict=True), strict=True))
    assert by_token == {i: (16 * i + 3, (10 * i + i) * 16 + 3) for i in range(3)}


def test_index_tensors_move_to_the_device_as_one_copy_and_masks_are_made_on_demand() -> None:
    """On a GPU the builder moves a step's index tensors with one copy (move_index_tensors); here the "device" is a
    clone, and every tensor must come back as a view of that one copy, with its values and shape. The SDPA mask is
    made only when the gather path asks for it (the paged path never does), once per step."""
    from serving.engine.batch import move_index_tensors

    seqs = [SequenceInput([1, 2, 3], start_pos=2, block_table=[0, 5], logits_offsets=[2]),
            SequenceInput([4], start_pos=6, block_table=[1, 2], logits_offsets=[0]),
            SequenceInput([5, 6], start_pos=0, block_table=[3], logits_offsets=[0, 1])]
    batch = build_forward_batch(seqs, block_size=4, n_rep=2, device=CPU)
    names = ("block_tables", "q_start", "seq_lens", "query_index", "valid_index")
    before = {"ids": batch.input_ids.clone(), "pos": batch.positions.clone(), "slots": batch.slot_mapping.clone(),
              "logits": batch.logits_index.clone()}
    before_groups = [{n: getattr(g, n).clone() for n in names if getattr(g, n) is not None} for g in batch.groups]
    assert any("query_index" in g for g in before_groups)  # a padded group: every kind of index tensor is there
    moved: list[torch.Tensor] = []

    def move(flat: torch.Tensor) -> torch.Tensor:
        moved.append(flat.clone())
        return moved[-1]

    move_index_tensors(batch, move)
    assert len(moved) == 1
    storage = moved[0].untyped_storage().data_ptr()
    after = {"ids": batch.input_ids, "pos": batch.positions, "slots": batch.slot_mapping, "logits": batch.logits_index}
    for key, t in after.items():
        assert torch.equal(t, before[key]) and t.untyped_storage().data_ptr() == storage, key
    for group, old in zip(batch.groups, before_groups, strict=True):
        for name, t in old.items():
            new = getattr(group, name)
            assert torch.equal(new, t) and new.untyped_storage().data_ptr() == storage, name
    assert sum(t.numel() for t in after.values()) + sum(t.numel() for g in before_groups for t in g.values()) \
        == moved[0].numel()

    group = next(g for g in batch.groups if g.query_pos is not None)
    assert group._mask is None  # not made until asked
    mask = group.mask
    assert mask is not None and group.mask is mask  # made once, then shared by every layer


def test_gathered_groups_keep_their_keys_small_and_in_place_groups_are_not_split() -> None:
    """64 decoding sequences of ~300 keys: gathered, a group holds at most MAX_GROUP_KEYS keys (its copy stays in
    the CPU's caches); read in place by the kernel, they are one group. Longer queries (a prefill chunk) gather
    and keep the cap either way. In place, decodes and verifies of any length up to in_place_max_q share one group
    (the kernel walks each sequence's own query tokens, so padding costs nothing there); gathered, query padding
    splits them."""
    decode_q, decode_ctx = [1] * 64, [300 + i for i in range(64)]
    gathered = group_sequences(decode_q, decode_ctx)
    assert len(gathered) > 8 and all(len(g) * max(decode_ctx[i] for i in g) <= MAX_GROUP_KEYS for g in gathered)
    assert group_sequences(decode_q, decode_ctx, in_place_max_q=16) == [sorted(range(64), key=lambda i: -i)]

    q_lens = [9, 9, 1, 1, 1, 400]  # two verify steps, three decodes, a prefill chunk
    ctx_lens = [300, 310, 300, 305, 290, 900]
    groups = group_sequences(q_lens, ctx_lens, in_place_max_q=16)
    assert [sorted(g) for g in groups] == [[5], [0, 1, 2, 3, 4]]
    gathered_mixed = group_sequences(q_lens, ctx_lens)
    assert [sorted(g) for g in gathered_mixed] == [[5], [0, 1], [2, 3, 4]]  # 9-token padding for a decode: too much
    assert [sorted(g) for g in group_sequences(q_lens, ctx_lens, in_place_max_q=8)] == [[5], [0, 1], [2, 3, 4]]
    assert [sorted(g) for g in group_sequences([1] * 10, [1500] * 10, in_place_max_q=0)] == [[i] for i in range(10)]

    seqs = [SequenceInput([7], 300 + i, list(range(i * 24, i * 24 + 24)), [0]) for i in range(64)]
    builder = ForwardBatchBuilder(block_size=16, n_rep=2, device=CPU)
    assert len(builder.build(seqs).groups) == len(gathered)
    builder.in_place_max_q = 16
    (group,) = builder.build(seqs).groups
    assert group.num_seqs == 64 and group.uniform and group.seq_lens is not None
    assert group.seq_lens.tolist() == [301 + i for i in range(64)][::-1]  # each sequence keeps its own length
