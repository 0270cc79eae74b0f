"""Timing one forward of a model through the engine's own path (batch metadata, layers, lm_head, argmax).

Used where a choice is measured rather than assumed: the speculative bench's ceiling, the draft's cost per
token, and whether a model's matmul weights are packed for oneDNN on CPU (serving.engine.kernels.cpu_linear).
`interleaved_medians` is how every start-up choice times its alternatives (weight packing, the draft rollout,
the CPU attention kernel).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from serving.engine.batch import SequenceInput, build_forward_batch
from serving.engine.kv_cache import BlockManager, KVCache
from serving.engine.model import Transformer
from serving.engine.sampling import greedy_tokens


def interleaved_medians(variants: Sequence[Callable[[], float]], rounds: int, min_rounds: int | None = None,
                        budget_s: float | None = None) -> list[float]:
    """The median of each variant's seconds (each call returns what it measured) over rounds that call every
    variant once, in turn, so that a busy moment of a shared machine weighs on all alike. With budget_s, no
    further round starts once min_rounds are done and that many seconds have passed (large models)."""
    times: list[list[float]] = [[] for _ in variants]
    started = time.perf_counter()
    for i in range(rounds):
        for variant, taken in zip(variants, times, strict=True):
            taken.append(variant())
        if budget_s is not None and i + 1 >= (min_rounds or 1) and time.perf_counter() - started > budget_s:
            break
    return [statistics.median(taken) for taken in times]


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
        greedy_tokens(model.compute_logits(model(batch, cache), batch.logits_index)).tolist()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
