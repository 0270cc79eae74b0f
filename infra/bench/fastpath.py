"""Side-by-side timings behind the engine's fast-path choices (docs/benchmarks/log.md), printed as ratios:

- attention of one group: gather + SDPA (the CPU path) vs FlexAttention straight from the paged cache
  (the CUDA path), with the largest absolute difference of their outputs;
- step metadata: a ForwardBatchBuilder kept across steps vs a new one per step;
- CPU decode and verify attention: the model's attention over an 8-layer cache larger than the CPU's
  caches, gather + SDPA vs the C++ kernel reading the paged cache in place (serving.engine.kernels.cpu_attention),
  per group shape, with the largest difference of their outputs.

    python -m infra.bench.fastpath [--runs 20]

Runs interleave the two variants so that the machine's load of a given moment weighs on both alike. The
FlexAttention block mask is built once per step in the engine; its time is printed apart.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from serving.engine.batch import ForwardBatchBuilder, SequenceInput, build_forward_batch
from serving.engine.kernels import cpu_attention
from serving.engine.kernels.paged_attention import paged_attention, paged_block_mask
from serving.engine.kv_cache import KVCache
from serving.engine.model import Attention, ModelArgs

_KV_HEADS, _N_REP, _HEAD_DIM, _BLOCK, _NUM_BLOCKS = 4, 2, 32, 16, 512  # the demo target's attention shape
ATTENTION_CASES = ((1, 200, 1), (8, 200, 1), (16, 100, 1), (4, 200, 5))  # (sequences, context, queries)
# (sequences, context, query tokens): decode, and verify steps through the decode walk (<= 3 tokens) and the tiled
# one (>= 4 tokens, up to model.KERNEL_MAX_QUERY)
KERNEL_CASES = ((1, 256, 1), (1, 256, 3), (1, 256, 9), (1, 256, 16), (4, 256, 3), (4, 256, 9), (16, 256, 1),
                (16, 256, 3), (16, 256, 5), (16, 256, 9), (32, 200, 1), (64, 200, 1), (64, 200, 2))
_KERNEL_LAYERS, _KERNEL_BLOCKS = 8, 4096  # 128 MiB of K and V: the cache does not sit in the CPU's caches


def _timed(fn: Callable[[], object], times: list[float]) -> None:
    start = time.perf_counter()
    fn()
    times.append((time.perf_counter() - start) * 1e3)


def compare_attention(num_seqs: int, context: int, queries: int, runs: int) -> str:
    cache = KVCache(1, _NUM_BLOCKS, _BLOCK, _KV_HEADS, _HEAD_DIM, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    per_seq = -(-(context + queries) // _BLOCK)
    blocks = torch.randperm(_NUM_BLOCKS, generator=g).tolist()
    seqs = [SequenceInput([0] * queries, context, blocks[i * per_seq : (i + 1) * per_seq], [0])
            for i in range(num_seqs)]
    group = build_forward_batch(seqs, _BLOCK, _N_REP, torch.device("cpu")).groups[0]
    q = torch.randn(num_seqs, _KV_HEADS * _N_REP, queries, _HEAD_DIM, generator=g)  # [G, Hq, max_q, D]
    scale = _HEAD_DIM**-0.5
    k_blocks, v_blocks = cache.layer_blocks(0)

    def gathered() -> torch.Tensor:
        qg = q.view(num_seqs, _KV_HEADS, _N_REP * queries, _HEAD_DIM)
        k, v = cache.gather(0, group.block_tables, group.key_len)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.mask, scale=scale)
        return o.view(num_seqs, _KV_HEADS * _N_REP, queries, _HEAD_DIM)

    mask = paged_block_mask(group, _NUM_BLOCKS, _BLOCK)

    def paged() -> torch.Tensor:
        return paged_attention(q, k_blocks, v_blocks, mask, scale)

    diff = (gathered() - paged()).abs().max().item()  # the first paged call compiles
    t_gather: list[float] = []
    t_paged: list[float] = []
    t_mask: list[float] = []
    with torch.inference_mode():
        for _ in range(runs):
            _timed(gathered, t_gather)
            _timed(paged, t_paged)
            _timed(lambda: paged_block_mask(group, _NUM_BLOCKS, _BLOCK), t_mask)
    tg, tp, tm = (statistics.median(t) for t in (t_gather, t_paged, t_mask))
    return (f"| {num_seqs} | {context} | {queries} | {tg:.3f} | {tp:.3f} | {tp / tg:.2f} | {tm:.3f} | "
            f"{diff:.1e} |")


def compare_builders(concurrency: int, runs: int) -> str:
    cpu = torch.device("cpu")
    kept = ForwardBatchBuilder(_BLOCK, _N_REP, cpu)
    seqs = [SequenceInput([7], 150 + i, list(range(i * 12, i * 12 + 12)), [0]) for i in range(concurrency)]
    fresh_ms: list[float] = []
    kept_ms: list[float] = []
    for _ in range(runs):
        _timed(lambda: build_forward_batch(seqs, _BLOCK, _N_REP, cpu), fresh_ms)
        _timed(lambda: kept.build(seqs), kept_ms)
    fresh, reused = statistics.median(fresh_ms) * 1e3, statistics.median(kept_ms) * 1e3
    return f"| {concurrency} | {fresh:.0f} | {reused:.0f} | {reused / fresh:.2f} |"


def compare_kernel(kernel: cpu_attention.DecodeAttentionKernel, cache: KVCache, num_seqs: int, context: int,
                   queries: int, runs: int) -> str:
    """Every layer's attention of one step through Attention.attend_group, gathered vs the kernel (any query
    length: the engine sends the kernel only groups of up to model.KERNEL_MAX_QUERY tokens)."""
    args = ModelArgs(vocab_size=16, dim=_KV_HEADS * _N_REP * _HEAD_DIM, n_layers=_KERNEL_LAYERS,
                     n_heads=_KV_HEADS * _N_REP, n_kv_heads=_KV_HEADS, head_dim=_HEAD_DIM, intermediate_size=16,
                     norm_eps=1e-5, max_position_embeddings=4096)
    attention = Attention(args)
    g = torch.Generator().manual_seed(num_seqs * 1000 + queries)
    per_seq = -(-(context + queries) // _BLOCK)
    order = torch.randperm(cache.num_blocks, generator=g)[: num_seqs * per_seq].view(num_seqs, per_seq)
    seqs = [SequenceInput([0] * queries, context - (i % 5) * 3, order[i].tolist(), list(range(queries)))
            for i in range(num_seqs)]
    batch = build_forward_batch(seqs, _BLOCK, _N_REP, torch.device("cpu"))
    q = torch.randn(batch.num_tokens, args.n_heads, _HEAD_DIM, generator=g)

    def step(through: cpu_attention.DecodeAttentionKernel | None) -> torch.Tensor:
        attention.decode_kernel = through
        return torch.cat([attention.attend_group(q, group, cache, layer)
                          for layer in range(_KERNEL_LAYERS) for group in batch.groups])

    with torch.inference_mode():
        diff = (step(None) - step(kernel)).abs().max().item()
        t_gather: list[float] = []
        t_kernel: list[float] = []
        for _ in range(runs):
            _timed(lambda: step(None), t_gather)
            _timed(lambda: step(kernel), t_kernel)
    tg, tk = (statistics.median(t) / _KERNEL_LAYERS for t in (t_gather, t_kernel))
    return f"| {num_seqs} | {context} | {queries} | {tg:.3f} | {tk:.3f} | {tk / tg:.2f} | {diff:.1e} |"


def kernel_table(runs: int) -> list[str]:
    try:
        kernel = cpu_attention.load()
    except cpu_attention.KernelUnavailable as e:
        return [f"CPU attention kernel: not available here ({e})"]
    cache = KVCache(_KERNEL_LAYERS, _KERNEL_BLOCKS, _BLOCK, _KV_HEADS, _HEAD_DIM, torch.float32,
                    torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    lines = [f"CPU attention kernel ({kernel.origin}), per layer, {_KERNEL_LAYERS} layers a step:",
             "| sequences | context | query tokens | gather + SDPA ms | kernel ms | kernel / gather | max abs diff |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    return lines + [compare_kernel(kernel, cache, n, ctx, q, runs) for n, ctx, q in KERNEL_CASES]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=20, help="timed runs per variant (interleaved)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    lines = ["| sequences | context | queries | gather + SDPA ms | FlexAttention ms | flex / gather | "
             "block mask ms (once per step) | max abs diff |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [compare_attention(g, ctx, q, args.runs) for g, ctx, q in ATTENTION_CASES]
    lines += ["", "| decode sequences | builder per step us | kept builder us | kept / per step |",
              "| --- | --- | --- | --- |"]
    lines += [compare_builders(c, 15 * args.runs) for c in (1, 32)]
    lines += ["", *kernel_table(max(args.runs // 2, 3))]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
