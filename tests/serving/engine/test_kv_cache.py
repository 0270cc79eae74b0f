from __future__ import annotations

import torch

from serving.engine.kv_cache import BlockManager, KVCache, kv_bytes_per_block


def test_allocate_grows_by_whole_blocks_and_free_returns_them() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4)
    assert blocks.allocate("a", 5)
    assert len(blocks.block_table("a")) == 2
    assert blocks.allocate("a", 8)  # still two blocks
    assert len(blocks.block_table("a")) == 2
    assert blocks.allocate("a", 9)
    assert blocks.num_used == 3
    blocks.free("a")
    assert blocks.num_free == 8 and blocks.block_table("a") == []


def test_allocation_beyond_the_pool_fails_without_side_effects() -> None:
    blocks = BlockManager(num_blocks=3, block_size=4)
    assert blocks.allocate("a", 8)
    assert not blocks.allocate("b", 8)
    assert blocks.num_free == 1 and blocks.block_table("b") == []
    assert not blocks.can_allocate("a", 13) and blocks.can_allocate("a", 12)


def test_truncate_rolls_back_whole_blocks_only() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4)
    blocks.allocate("a", 14)  # 4 blocks
    table = list(blocks.block_table("a"))
    blocks.truncate("a", 9)  # 3 blocks still needed
    assert blocks.block_table("a") == table[:3]
    assert blocks.num_free == 5
    blocks.truncate("a", 9)
    assert blocks.num_free == 5


def test_write_then_gather_reads_back_in_sequence_order() -> None:
    cache = KVCache(n_layers=1, num_blocks=4, block_size=2, n_kv_heads=1, head_dim=3, dtype=torch.float32,
                    device=torch.device("cpu"))
    k = torch.arange(9, dtype=torch.float32).view(3, 1, 3)
    slots = torch.tensor([6, 7, 2])  # positions 0,1 in block 3; position 2 in block 1
    cache.write(0, slots, k, -k)
    k_ctx, v_ctx = cache.gather(0, torch.tensor([[3, 1]]), 3)  # [1, Hkv, 3, D]
    assert torch.equal(k_ctx[0, 0, :3], k[:, 0])
    assert torch.equal(v_ctx[0, 0, :3], -k[:, 0])


def test_bytes_per_block() -> None:
    assert kv_bytes_per_block(2, 4, 8, 16, torch.bfloat16) == 2 * 2 * 16 * 4 * 8 * 2
