"""Timing one forward of a model through the engine's own path (batch metadata, layers, lm_head, argmax).

Used where a choice is measured rather than assumed: the speculative bench's ceiling, the draft's cost per
token, and whether a model's matmul weights are packed for oneDNN on CPU (serving.engine.cpu_linear).
"""

from __future__ import annotations

import statistics
import time

import torch

from serving.engine.batch import SequenceInput, build_forward_batch
from serving.engine.kv_cache import BlockManager, KVCache
from serving.engine.model import Transformer


@torch.inference_mode()
def forward_seconds(model: Transformer, context: int, new_tokens: int, repeats: int = 20) -> float:
    """Median time of one forward of new_tokens tokens after `context` cached ones (one sequence)."""
    args = model.args
    device, dtype = model.device, model.dtype
    block_size = 16
    num_blocks = -(-(context + new_tokens) // block_size)
    blocks = BlockManager(num_blocks, block_size)
    cache = KVCache(args.n_layers, num_blocks, block_size, args.n_kv_heads, args.head_dim, dtype, device)
    blocks.allocate("s", context + new_tokens)
    tokens = [1] * new_tokens
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        batch = build_forward_batch([SequenceInput(tokens, context, blocks.block_table("s"),
                                                   list(range(new_tokens)))], block_size, args.n_rep, device, dtype)
        model.compute_logits(model(batch, cache), batch.logits_index).argmax(-1).tolist()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
