"""Paged KV cache: a pool of fixed-size blocks and per-sequence block tables, with automatic prefix caching.

`KVCache` holds the tensors and knows how to write a step's K/V into slots and gather a sequence's blocks.
`BlockManager` does the bookkeeping: which blocks are free and which blocks each sequence owns. Growing,
freeing and truncating (rolling back rejected draft tokens) touch block ids only, never tensor data.

Prefix caching (as in vLLM/SGLang): once a block is full of computed tokens it is content-addressed by a
hash of its tokens chained with the previous block's hash, so the hash names the whole prefix up to the
block's end. Blocks are reference-counted; a block nobody holds keeps its K/V and its hash and waits in an
LRU list, evicted only when a new block is needed and no never-cached block is left. A new sequence takes
every cached full block of its tokens (`match_prefix`) and computes only the rest. Shared blocks are full
and sit before the sequence's computed length, so nothing is ever written into one.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

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
        # every layer's slots as one flat dimension ([n_layers * num_slots, Hkv, D]) and each layer's first slot
        # in it, for storing all layers' K/V of a step in one copy (write_layers)
        self._k_flat = self.k.view(-1, n_kv_heads, head_dim)
        self._v_flat = self.v.view(-1, n_kv_heads, head_dim)
        self._layer_start = torch.arange(n_layers, device=device)[:, None] * (num_blocks * block_size)  # [L, 1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [T, Hkv, D] at flat slots [T] (block * block_size + offset)."""
        self._k_slots[layer].index_copy_(0, slots, k)
        self._v_slots[layer].index_copy_(0, slots, v)

    def write_layers(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store every layer's k/v [n_layers, T, Hkv, D] at flat slots [T] (a decode step captured whole).

        One copy along the first dimension of the flat cache per tensor. Copying along the slot dimension of
        [n_layers, num_slots, ...] instead split into a kernel per layer once the cache passed 2^31 elements
        (32-bit indexing): 44 index-copy kernels per batch-1 step on an H200, 2 now (profiled)."""
        index = (self._layer_start + slots[None, :]).reshape(-1)  # [L * T]
        self._k_flat.index_copy_(0, index, k.reshape(-1, self.n_kv_heads, self.head_dim))
        self._v_flat.index_copy_(0, index, v.reshape(-1, self.n_kv_heads, self.head_dim))

    def layer_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer in place: [num_blocks, block_size, Hkv, D] each (the paged attention path)."""
        return self._k_blocks[layer], self._v_blocks[layer]

    def all_layer_blocks(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's K and V views (made once, so each keeps its identity: a captured graph's static inputs)."""
        return self._k_blocks, self._v_blocks

    def gather(
        self, layer: int, block_tables: torch.Tensor, key_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Context K/V of a group of sequences: block_tables [G, B] -> [G, Hkv, key_len, D] (key_len <= B * bs)."""
        g, b = block_tables.shape
        flat = block_tables.reshape(-1)  # index_select copies whole blocks, ~3x faster than advanced indexing
        k = self._k_blocks[layer].index_select(0, flat).view(g, b * self.block_size, self.n_kv_heads, self.head_dim)
        v = self._v_blocks[layer].index_select(0, flat).view(g, b * self.block_size, self.n_kv_heads, self.head_dim)
        return k[:, :key_len].transpose(1, 2), v[:, :key_len].transpose(1, 2)


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Content address of a full block: its tokens chained with its parent's address (b"" for the first block).
    A 128-bit digest, so two different prefixes never share cached K/V in practice."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockManager:
    """Allocates cache blocks to sequences and caches full blocks by content. Every operation is O(blocks touched)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # never-cached blocks; pop() gives low ids first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, least recent first
        self._ref = [0] * num_blocks  # sequences holding each block
        self._hash_of: dict[int, bytes] = {}  # block -> content address, for cached blocks
        self._block_of: dict[bytes, int] = {}  # content address -> cached block
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # seq -> addresses of its leading full, computed blocks

    @property
    def num_free(self) -> int:
        """Blocks a sequence can get now: never-cached ones plus cached ones nobody holds (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks with a content address (held or evictable)."""
        return len(self._block_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(self.block_table(seq_id)) <= self.num_free

    def match_prefix(self, seq_id: str, token_ids: Sequence[int]) -> int:
        """Start a sequence on the cached blocks of its longest cached prefix; returns the tokens they hold.

        At most len(token_ids) - 1 tokens come from the cache: the last token is always computed, so the step
        that finishes the prefill has logits to sample from. The sequence must hold no blocks yet."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks; match_prefix starts a new one")
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        table: list[int] = []
        hashes: list[bytes] = []
        parent = b""
        for i in range((len(token_ids) - 1) // bs):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            block = self._block_of.get(parent)
            if block is None:
                break
            self._take(block)
            table.append(block)
            hashes.append(parent)
        if table:
            self._tables[seq_id] = table
            self._hashes[seq_id] = hashes
        return len(table) * bs

    def commit(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Give content addresses to the sequence's blocks that are now full of computed tokens.

        token_ids: the sequence's tokens (at least num_computed_tokens of them). A block whose address is
        already cached elsewhere (two sequences computed the same prefix at once) stays private and uncached."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(seq_id)
        if table is None:
            return
        hashes = self._hashes.setdefault(seq_id, [])
        bs = self.block_size
        for i in range(len(hashes), min(num_computed_tokens // bs, len(table))):
            parent = hashes[-1] if hashes else b""
            digest = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(digest)
            block = table[i]
            if digest not in self._block_of and block not in self._hash_of:
                self._block_of[digest] = block
                self._hash_of[block] = digest

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Grow the sequence's table to hold num_tokens; False (and nothing changed) if blocks run out."""
        table = self._tables.get(seq_id, [])
        needed = self.blocks_for(num_tokens) - len(table)
        if needed > self.num_free:
            return False
        if needed > 0:
            self._tables[seq_id] = table
            for _ in range(needed):
                table.append(self._new_block())
        return True

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Shrink to num_tokens (rejected draft tokens): blocks past the end go back to the pool."""
        table = self._tables.get(seq_id)
        if table is None:
            return
        keep = self.blocks_for(num_tokens)
        hashes = self._hashes.get(seq_id)
        if hashes is not None and len(hashes) > keep:
            del hashes[keep:]
        while len(table) > keep:
            self._release(table.pop())

    def free(self, seq_id: str) -> None:
        """The sequence is done (finished, aborted or preempted): drop its hold on every block.
        The tail is released first, so under pressure a prefix's tail is evicted before its head."""
        table = self._tables.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        for block in reversed(table or []):
            self._release(block)

    # ---- one block ------------------------------------------------------------------------------------

    def _new_block(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # evict the least recently used cached block
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        self._ref[block] = 1
        return block

    def _take(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._evictable[block]
        self._ref[block] += 1

    def _release(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] > 0:
            return
        if block in self._hash_of:
            self._evictable[block] = None  # most recently used end
        else:
            self._free.append(block)
