"""Compiled steps: the forward of small steps (decode, verify) padded to a few token-count buckets, so each
bucket has static shapes and is compiled once, at start-up, before the server reports ready.

Attention is the one part whose work depends on the step's layout (block tables, context lengths, groups),
so it stays out of the graph: `specdeploy::attention` is an opaque custom op that reads the step's batch and
cache from a context set around the call, writes the real tokens' K/V and attends them. Everything else —
embeddings, norms, projections, RoPE, the MLP — is one graph per bucket over `bucket` rows; padding rows
(token 0 at position 0) go through the dense layers, are skipped by attention and dropped at the end.

Decode steps (one token per sequence, the whole of batch-1 decoding) can instead be captured whole, attention
included, when attention reads the paged cache in place (FlexAttention: the engine's path on CUDA). The graph
takes the rows' block tables padded to a static width and the cached context lengths, reads the cache without
writing it (`CapturedDecode`: context from the cache plus the new token beside it) and returns the new K/V,
which the step stores right after the replay. One replay then runs the step's every kernel, instead of the
per-layer attention calls between graph pieces. On CUDA we capture these graphs ourselves (`DecodeGraph`: static
input buffers, `torch.cuda.CUDAGraph`), so a step costs the host a few copies and one replay, not a call through
dynamo's guards and inductor's cudagraph trees (measured on an H200 in docs/benchmarks/log.md). Inductor cannot lower
the log-sum-exp this needs on CPU (torch 2.13), so on CPU the whole-decode path runs only under test backends
("eager", "aot_eager").

Whether compiling pays is measured per bucket at warm-up (eager and compiled step time, side by side) and a
bucket keeps its compiled graph only if it is faster: on a small CPU model the launch overhead saved can be
smaller than the guard and wrapper overhead added. On CUDA the compiled graph is captured per bucket with
inductor's CUDA graphs (`mode="reduce-overhead"`); measured on an H200 in docs/benchmarks/log.md.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

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
_buckets_requested = 0  # buckets of every CompiledForward made in this process (dynamo's recompile limit)


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
    # the paged path's FlexAttention is compiled on its own, per new shape (a verify step's queries, a longer
    # block table): the serving stance that forbids recompiling this step's graph must not forbid that
    with torch.compiler.set_stance("default"):
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
    kind: str = "step"  # "step": attention between graph pieces; "decode": a decode step captured whole


class CompiledForward:
    """Runs a step's forward through the compiled graph of its bucket, or eagerly when it has none."""

    def __init__(self, model: Transformer, buckets: list[int], cuda_graphs: bool | None = None,
                 whole_decode: bool | None = None, max_decode_rows: int | None = None,
                 backend: str = "inductor") -> None:
        self.model = model
        self.buckets = sorted(buckets)
        self.backend = backend  # "inductor"; tests use "eager" to trace without code generation
        self.cuda_graphs = model.device.type == "cuda" and backend == "inductor" if cuda_graphs is None \
            else cuda_graphs
        self.graphs: dict[int, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}
        # decode steps captured whole: needs attention from the paged cache in place (the engine's CUDA path)
        if whole_decode is None:
            whole_decode = model.device.type == "cuda" and model.paged_attention
        if whole_decode and not model.paged_attention:
            raise ValueError("whole-decode graphs need paged attention (Transformer.set_paged_attention(True))")
        self.whole_decode = whole_decode
        self.max_decode_rows = max_decode_rows or self.buckets[-1]  # a decode step has one row per sequence
        self.decode_graphs: dict[int, DecodeGraph] = {}
        self._graph_pool: Any = None  # the memory pool the decode graphs of this forward share (CUDA)
        self._decode_cache: KVCache | None = None  # the cache the decode graphs read (set at warm-up)
        self.decisions: list[BucketDecision] = []
        self.steps_compiled = 0  # steps that ran through a compiled graph (either kind)
        self.steps_whole_decode = 0  # ... of them, decode steps captured whole
        # every bucket of every CompiledForward in the process (a target and its draft) is a recompile of the
        # same code: past dynamo's limit a bucket fails to compile and runs eagerly (process-wide, only raised)
        global _buckets_requested
        _buckets_requested += len(self.buckets)
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, _buckets_requested + 2)

    def bucket_for(self, num_tokens: int) -> int | None:
        for b in self.buckets:
            if b >= num_tokens:
                return b
        return None

    def __call__(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        n = batch.num_tokens
        bucket = self.bucket_for(n)
        graph = self.graphs.get(bucket) if bucket is not None else None
        if bucket is not None and bucket in self.decode_graphs and is_decode(batch):
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    hidden = self._run_decode(self.decode_graphs[bucket], batch, cache)
            except Exception as exc:  # as below: this bucket's decode steps run through the other path from now on
                log.warning("captured %d-row decode step refused (%s); it runs piecewise", bucket, exc)
                del self.decode_graphs[bucket]
            else:  # the graph wrote nothing: no K/V of a failed replay can be half-stored
                self.steps_compiled += 1
                self.steps_whole_decode += 1
                return hidden
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
        if self.whole_decode:
            self._decode_cache = cache
            if self.cuda_graphs:
                # the graphs read these in place: static inputs are not copied into the graph's pool per replay
                k_layers, v_layers = cache.all_layer_blocks()
                for t in [*k_layers, *v_layers, self.model.rope_cos, self.model.rope_sin]:
                    torch._dynamo.mark_static_address(t)
        with torch.inference_mode():  # as steps run (ModelRunner.execute): inference tensors, no autograd guards
            for bucket in self.buckets:
                self._warm_up_bucket(bucket, cache, builder, measure)
                if self.whole_decode and bucket <= self.max_decode_rows:
                    self._warm_up_decode(bucket, cache, builder, measure)
        return self.decisions

    def _warm_up_decode(self, bucket: int, cache: KVCache, builder: ForwardBatchBuilder, measure: bool) -> None:
        batch = _dummy_batch(builder, bucket, cache)
        if self.cuda_graphs and self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = DecodeGraph(self._compile_decode(cache), bucket, -(-self.model.max_model_len // cache.block_size),
                            self.model.device, capture=self.cuda_graphs, pool=self._graph_pool)
        run = functools.partial(self._run_decode, graph, batch, cache)
        try:
            graph.prepare()
            compiled_ms = self._time(run)
        except Exception as exc:
            log.warning("capturing the %d-row decode step failed; it runs piecewise: %r", bucket, exc)
            self.decisions.append(BucketDecision(bucket, 0.0, 0.0, False, f"compile failed: {exc!r}"[:300],
                                                 "decode"))
            return
        if measure:
            eager_ms, compiled_ms = self._time_side_by_side(functools.partial(self.model, batch, cache), run)
            keep = eager_ms >= _MIN_GAIN * compiled_ms
        else:
            eager_ms, keep = 0.0, True
        if keep:
            self.decode_graphs[bucket] = graph
        self.decisions.append(BucketDecision(bucket, eager_ms, compiled_ms, keep, kind="decode"))
        log.info("%d-row decode step: eager %.2f ms, captured whole %.2f ms -> %s", bucket, eager_ms, compiled_ms,
                 "captured" if keep else "not used")

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

        compiled: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.compile(
            dense_forward, fullgraph=True, dynamic=False, backend=self.backend, mode=self._mode()
        )
        return compiled

    def _mode(self) -> str | None:
        if self.backend != "inductor":
            return None  # modes are inductor's
        return "reduce-overhead" if self.cuda_graphs else None  # reduce-overhead = CUDA graphs per shape

    def _compile_decode(self, cache: KVCache) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        model = self.model

        def decode_forward(input_ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                           ctx_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return model.forward_decode(input_ids, positions, tables, ctx_lens, cache)

        # no mode: DecodeGraph captures the CUDA graph itself (inductor's cudagraph trees would add their own)
        compiled: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = torch.compile(
            decode_forward, fullgraph=True, dynamic=False, backend=self.backend
        )
        return compiled

    def _run_decode(self, graph: DecodeGraph, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        if cache is not self._decode_cache:
            raise RuntimeError("a captured decode step runs on the cache it was captured with only")
        return graph.run(batch, cache)

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


def is_decode(batch: ForwardBatch) -> bool:
    """One query token per sequence (decode proper, or a one-token prefill)."""
    return all(group.max_q == 1 for group in batch.groups)


def fill_decode_inputs(batch: ForwardBatch, input_ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                       ctx_lens: torch.Tensor) -> int:
    """Copy a decode batch into a bucket's static inputs, in flat-row order: token ids, positions, block tables
    [rows, width] int32 and cached context lengths. Returns the batch's row count n.

    Only the first n rows and, per row, the table entries the batch has are written: entries past a row's
    context blocks are never read, and rows past n keep an earlier step's inputs (or the zeros they started
    with) — valid inputs whose outputs are dropped and never stored, so they cost no copy per step."""
    n = batch.num_tokens
    input_ids[:n].copy_(batch.input_ids)
    positions[:n].copy_(batch.positions)
    for group in batch.groups:  # decode groups: one row per sequence, contiguous in flat order
        assert group.seq_lens is not None
        span = slice(group.token_start, group.token_end)
        tables[span, : group.block_tables.shape[1]].copy_(group.block_tables)
        torch.sub(group.seq_lens, 1, out=ctx_lens[span])  # the new token is not in the cache yet
    return n


class DecodeGraph:
    """One bucket's decode step captured whole, on static input buffers of `rows` rows.

    On CUDA (capture=True) `prepare` compiles the step, warms it up on a side stream and captures it into a
    `torch.cuda.CUDAGraph`; a step then copies its rows into the buffers, replays the graph and stores the new
    K/V. Replaying our own graph skips what calling the compiled function costs the host on every step:
    dynamo's guards, and inductor's cudagraph trees with their own input copies and checks. Without capture
    (CPU tests, backend "eager") a step calls the compiled function on the same buffers."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]], rows: int, width: int,
                 device: torch.device, capture: bool, pool: Any = None) -> None:
        self.fn, self.capture, self.pool = fn, capture, pool
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.tables = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self.ctx_lens = torch.zeros(rows, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # the graph's, when captured

    def _call(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.fn(self.input_ids, self.positions, self.tables, self.ctx_lens)

    def prepare(self) -> None:
        """Compile the step (its first call) and, with capture, record the graph. Raises if either fails."""
        if not self.capture:
            self._call()
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile, autotune and library handles happen outside the capture
            for _ in range(2):
                self._call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call of another thread during the capture is not an error of this one
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.outputs = self._call()
        self.graph = graph

    def run(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        n = fill_decode_inputs(batch, self.input_ids, self.positions, self.tables, self.ctx_lens)
        if self.graph is not None:
            assert self.outputs is not None
            self.graph.replay()
            hidden, new_k, new_v = self.outputs
        else:
            hidden, new_k, new_v = self._call()
        # the real rows' K/V go to their slots now, before the next replay overwrites the graph's outputs;
        # padding rows are not stored
        cache.write_layers(batch.slot_mapping, new_k[:, :n], new_v[:, :n])
        return hidden[:n].clone() if self.graph is not None else hidden[:n]


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
