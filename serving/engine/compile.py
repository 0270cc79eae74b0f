"""Compiled steps: the forward of small steps (decode, verify) padded to a few token-count buckets, so each
bucket has static shapes and is compiled once, at start-up, before the server reports ready.

Attention is the one part whose work depends on the step's layout (block tables, context lengths, groups),
so it stays out of the graph: `specdeploy::attention` is an opaque custom op that reads the step's batch and
cache from a context set around the call, writes the real tokens' K/V and attends them. Everything else —
embeddings, norms, projections, RoPE, the MLP — is one graph per bucket over `bucket` rows; padding rows
(token 0 at position 0) go through the dense layers, are skipped by attention and dropped at the end.

Whether compiling pays is measured per bucket at warm-up (eager and compiled step time, side by side) and a
bucket keeps its compiled graph only if it is faster: on a small CPU model the launch overhead saved can be
smaller than the guard and wrapper overhead added. On CUDA the compiled graph is captured per bucket with
inductor's CUDA graphs (`mode="reduce-overhead"`); measured on an H200 in docs/engine.md.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from serving.engine.batch import ForwardBatch, ForwardBatchBuilder, SequenceInput
from serving.engine.kv_cache import KVCache
from serving.engine.model import Transformer, TransformerBlock

log = logging.getLogger(__name__)

# Token-count buckets of compiled steps: a decode step of B sequences runs B tokens, a verify step B * (1 + k).
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# A bucket keeps its compiled graph only when it is at least this much faster than eager at warm-up.
_MIN_GAIN = 1.05
_TIMING_RUNS = 15


@dataclass
class _StepContext:
    model: Transformer
    batch: ForwardBatch
    cache: KVCache


_context: _StepContext | None = None


@contextmanager
def step_context(model: Transformer, batch: ForwardBatch, cache: KVCache) -> Iterator[None]:
    """The batch and cache the attention op of a compiled forward reads (one engine thread runs steps)."""
    global _context
    previous, _context = _context, _StepContext(model, batch, cache)
    try:
        yield
    finally:
        _context = previous


# cudagraph_unsafe: inductor partitions the graph around it (graph_partition), capturing the layers between
# attention calls as CUDA graphs while the attention op itself runs outside them, with this step's metadata
@torch.library.custom_op("specdeploy::attention", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """q [bucket, Hq, D], k/v [bucket, Hkv, D] -> [bucket, Hq * D]; rows past the step's tokens are padding."""
    ctx = _context
    if ctx is None:
        raise RuntimeError("specdeploy::attention called outside a compiled step (no step_context)")
    n = ctx.batch.num_tokens
    block = ctx.model.layers[layer]
    assert isinstance(block, TransformerBlock)
    real = block.attention.attend(q[:n], k[:n], v[:n], ctx.batch, ctx.cache, layer)
    if n == q.shape[0]:
        return real
    out = real.new_zeros(q.shape[0], real.shape[1])
    out[:n] = real
    return out


@attention_op.register_fake
def _attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def buckets_up_to(max_tokens: int) -> list[int]:
    """The buckets a step of at most max_tokens tokens can need (the smallest bucket >= max_tokens included)."""
    chosen = [b for b in BUCKETS if b < max_tokens]
    larger = [b for b in BUCKETS if b >= max_tokens]
    return chosen + larger[:1]


@dataclass
class BucketDecision:
    tokens: int  # the bucket: steps of up to this many tokens
    eager_ms: float  # step forward time at warm-up, eager
    compiled_ms: float  # ... and compiled (0 when compiling failed)
    compiled: bool  # the compiled graph is used for this bucket
    note: str = ""


class CompiledForward:
    """Runs a step's forward through the compiled graph of its bucket, or eagerly when it has none."""

    def __init__(self, model: Transformer, buckets: list[int], cuda_graphs: bool | None = None) -> None:
        self.model = model
        self.buckets = sorted(buckets)
        self.cuda_graphs = model.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graphs: dict[int, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}
        self.decisions: list[BucketDecision] = []
        self.steps_compiled = 0  # steps that ran through a compiled graph
        # every bucket is a recompile of the same code (process-wide setting, made when an engine compiles)
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, len(self.buckets) + 2)

    def bucket_for(self, num_tokens: int) -> int | None:
        for b in self.buckets:
            if b >= num_tokens:
                return b
        return None

    def __call__(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        n = batch.num_tokens
        bucket = self.bucket_for(n)
        graph = self.graphs.get(bucket) if bucket is not None else None
        if graph is None or bucket is None:
            return self.model(batch, cache)
        try:
            # never compile while serving: warm-up compiled every bucket for exactly the inputs steps bring
            with torch.compiler.set_stance("fail_on_recompile"):
                hidden = self._run(graph, batch, cache)
        except Exception as exc:  # a guard the warm-up did not foresee: this bucket runs eagerly from now on
            log.warning("compiled %d-token step refused (%s); the bucket runs eagerly", bucket, exc)
            del self.graphs[bucket]
            return self.model(batch, cache)  # rewrites the same K/V if the graph got as far as writing them
        self.steps_compiled += 1
        return hidden[:n]

    def warm_up(self, cache: KVCache, builder: ForwardBatchBuilder, measure: bool = True) -> list[BucketDecision]:
        """Compile (and on CUDA capture) every bucket; with measure, keep only the buckets where it pays.

        Runs on an engine with no request yet: the dummy steps write K/V into blocks nobody holds."""
        self.decisions = []
        with torch.inference_mode():  # as steps run (LLMEngine.execute): inference tensors, no autograd guards
            for bucket in self.buckets:
                self._warm_up_bucket(bucket, cache, builder, measure)
        return self.decisions

    def _warm_up_bucket(self, bucket: int, cache: KVCache, builder: ForwardBatchBuilder, measure: bool) -> None:
        batch = _dummy_batch(builder, bucket, cache)
        graph = self._compile()
        try:
            # the first call compiles; with CUDA graphs the next ones warm up and record the bucket's graph,
            # so that no capture is left for the first requests
            for _ in range(3 if self.cuda_graphs else 1):
                compiled_ms = self._time(functools.partial(self._run, graph, batch, cache))
        except Exception as exc:  # an op inductor cannot lower here: this bucket stays eager, and we say why
            log.warning("compiling the %d-token step failed; it runs eagerly: %r", bucket, exc)
            self.decisions.append(BucketDecision(bucket, 0.0, 0.0, False, f"compile failed: {exc!r}"[:300]))
            return
        if measure:
            eager_ms, compiled_ms = self._time_side_by_side(
                functools.partial(self.model, batch, cache), functools.partial(self._run, graph, batch, cache)
            )
            keep = eager_ms >= _MIN_GAIN * compiled_ms
        else:
            eager_ms, keep = 0.0, True
        if keep:
            self.graphs[bucket] = graph
        self.decisions.append(BucketDecision(bucket, eager_ms, compiled_ms, keep))
        log.info("%d-token step: eager %.2f ms, compiled %.2f ms -> %s", bucket, eager_ms, compiled_ms,
                 "compiled" if keep else "eager")

    def _compile(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        model = self.model

        def dense_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model.forward_tokens(input_ids, positions, None, None)

        mode = "reduce-overhead" if self.cuda_graphs else None  # reduce-overhead = CUDA graphs per shape
        compiled: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.compile(
            dense_forward, fullgraph=True, dynamic=False, mode=mode
        )
        return compiled

    def _run(self, graph: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], batch: ForwardBatch,
             cache: KVCache) -> torch.Tensor:
        bucket = self.bucket_for(batch.num_tokens)
        assert bucket is not None
        if self.cuda_graphs:
            # a new step: the graphs' static outputs of the previous one may be overwritten (cudagraph trees
            # cannot tell steps apart under inference_mode, and refuse to run without this)
            torch.compiler.cudagraph_mark_step_begin()
        with step_context(self.model, batch, cache):
            hidden = graph(_pad(batch.input_ids, bucket), _pad(batch.positions, bucket))
        # the graph's output lives in its static pool, overwritten by the next replay: the step keeps a copy
        return hidden.clone() if self.cuda_graphs else hidden

    def _time(self, fn: Callable[[], object]) -> float:
        sync = self.model.device.type == "cuda"
        with torch.inference_mode():
            if sync:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if sync:
                torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    def _time_side_by_side(self, eager: Callable[[], object], compiled: Callable[[], object]) -> tuple[float, float]:
        """Median ms of each, runs interleaved so that the load of a given moment weighs on both alike."""
        eager_ms, compiled_ms = [], []
        for _ in range(_TIMING_RUNS):
            eager_ms.append(self._time(eager))
            compiled_ms.append(self._time(compiled))
        return statistics.median(eager_ms), statistics.median(compiled_ms)


def _pad(t: torch.Tensor, size: int) -> torch.Tensor:
    if t.shape[0] == size:
        return t
    return torch.cat([t, t.new_zeros(size - t.shape[0])])


def _dummy_batch(builder: ForwardBatchBuilder, tokens: int, cache: KVCache) -> ForwardBatch:
    """A decode step of `tokens` sequences, each with one block of context, spread over the cache's blocks."""
    bs = cache.block_size
    seqs = [SequenceInput(token_ids=[0], start_pos=bs - 1, block_table=[i % cache.num_blocks], logits_offsets=[0])
            for i in range(tokens)]
    return builder.build(seqs)
