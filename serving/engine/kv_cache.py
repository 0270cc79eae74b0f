"""Paged KV cache: a pool of fixed-size blocks and per-sequence block tables.

`KVCache` holds the tensors and knows how to write a step's K/V into slots and gather a sequence's blocks.
`BlockManager` does the bookkeeping: which blocks are free and which blocks each sequence owns. Growing,
freeing and truncating (rolling back rejected draft tokens) touch block ids only, never tensor data.
"""

from __future__ import annotations

import torch


def kv_bytes_per_block(n_layers: int, n_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * n_layers * block_size * n_kv_heads * head_dim * element


class KVCache:
    """K and V for every layer: [n_layers, num_blocks, block_size, n_kv_heads, head_dim] each."""

    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (n_layers, num_blocks, block_size, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        # per-layer views made once: indexing self.k[layer] in every layer of every step costs more than it looks
        self._k_slots = [k.view(-1, n_kv_heads, head_dim) for k in self.k.unbind(0)]  # [num_slots, Hkv, D]
        self._v_slots = [v.view(-1, n_kv_heads, head_dim) for v in self.v.unbind(0)]
        self._k_blocks = list(self.k.unbind(0))  # [num_blocks, block_size, Hkv, D]
        self._v_blocks = list(self.v.unbind(0))

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [T, Hkv, D] at flat slots [T] (block * block_size + offset)."""
        self._k_slots[layer].index_copy_(0, slots, k)
        self._v_slots[layer].index_copy_(0, slots, v)

    def gather(
        self, layer: int, block_tables: torch.Tensor, key_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Context K/V of a group of sequences: block_tables [G, B] -> [G, Hkv, key_len, D] (key_len <= B * bs)."""
        g, b = block_tables.shape
        flat = block_tables.reshape(-1)  # index_select copies whole blocks, ~3x faster than advanced indexing
        k = self._k_blocks[layer].index_select(0, flat).view(g, b * self.block_size, self.n_kv_heads, self.head_dim)
        v = self._v_blocks[layer].index_select(0, flat).view(g, b * self.block_size, self.n_kv_heads, self.head_dim)
        return k[:, :key_len].transpose(1, 2), v[:, :key_len].transpose(1, 2)


class BlockManager:
    """Allocates cache blocks to sequences. Every operation is O(blocks touched)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: pop() hands out low ids first
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(self.block_table(seq_id)) <= len(self._free)

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Grow the sequence's table to hold num_tokens; False (and nothing changed) if blocks run out."""
        table = self._tables.setdefault(seq_id, [])
        needed = self.blocks_for(num_tokens) - len(table)
        if needed > len(self._free):
            if not table:
                del self._tables[seq_id]
            return False
        for _ in range(needed):
            table.append(self._free.pop())
        return True

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Shrink to num_tokens (rejected draft tokens): blocks past the end go back to the pool."""
        table = self._tables.get(seq_id)
        if table is None:
            return
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._free.append(table.pop())

    def free(self, seq_id: str) -> None:
        table = self._tables.pop(seq_id, None)
        if table:
            self._free.extend(reversed(table))
