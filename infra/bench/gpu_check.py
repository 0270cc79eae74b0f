"""The GPU check of issue 35 in one run: decode against the bandwidth bound, on Llama-3-8B and ~1.1B shapes.

For each model (random bf16 weights built on the device, nothing downloaded or saved), each mode (captured:
compiled steps with CUDA graphs and decode steps captured whole, as the engine runs on CUDA; captured+triton: the
same with the Triton paged decode attention of serving.engine.kernels.gpu_kernels; eager; eager+triton: eager with the
Triton attention and the fused residual + RMSNorm) and each batch (1, 16, 64 sequences, contexts cycling through
CONTEXT_MIX), it measures:

- end to end: engine steps (scheduling, forward, sampling, bookkeeping) once every request is decoding:
  tokens/s and ms per step (= ms per token of each sequence), and the forward alone (the step's forward and
  lm_head on the same rows, nothing else);
- % of the bound: the bound step reads the weights once (the embedding table excepted: a step reads B rows of
  it) plus, at batch > 1, every sequence's K/V, at the device's measured copy bandwidth (bytes read + written
  per second by a large device-to-device copy, as infra.bench.bandwidth measures it);
- kernels per step: device kernels and copies of an end-to-end step (torch.profiler);
- at batch 1 and 16: verify(k + 1) ÷ decode(1), the forward of k + 1 query tokens per sequence against one, on
  the same contexts, for k = 4, 8, 12: what a verification costs against the step it replaces.

Only the buckets the rows use are compiled (decode at 1, 16, 64 rows captured whole; the verify steps' piecewise
buckets), and captured+triton reuses the captured mode's piecewise graphs, recapturing only the decode graphs. It
prints one table and writes JSON (`--json`). A time budget (`--budget-s`) skips what is left, saying so, rather than
run past it: a captured mode starts only if its graphs fit the time left at the rate the last ones took. `make
gpu-check` runs it; `--dry-run` runs the same code on a tiny model on CPU (the captured mode traced with the eager
backend; the Triton modes refused there, their rows saying so), which the tests do so that the script is known to
run before a card is lent.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

# Hugging Face config fields of each measured shape. Llama-3-8B: 8.03B parameters, GQA 32/8, 128k vocabulary.
LLAMA3_8B: dict[str, Any] = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                                 rope_theta=500000.0, rms_norm_eps=1e-5)
# ~1.1B, TinyLlama-like: the row infra.bench.bandwidth has measured since the first lent runs.
ONE_B: dict[str, Any] = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                             num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)
TINY: dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
SHAPES = {"8b": LLAMA3_8B, "1b": ONE_B, "tiny": TINY}

CONTEXT_MIX = (128, 512, 1024, 2048)  # sequence i of a batch holds CONTEXT_MIX[i % 4] tokens
# captured: compiled steps with CUDA graphs, decode captured whole (the engine on CUDA); +triton: with the Triton
# kernels (serving.engine.kernels.gpu_kernels). In that order by default: the budget skips the last ones first.
MODES = ("captured", "captured+triton", "eager", "eager+triton")
VERIFY_KS = (4, 8, 12)
VERIFY_BATCHES = (1, 16)


@dataclass
class Plan:
    models: list[str]
    modes: list[str]
    batches: list[int]
    ks: list[int]
    steps: int  # timed end-to-end steps per row
    repeats: int  # timed forwards per forward-alone and verify figure
    budget_s: float
    device: str
    dtype: torch.dtype
    max_model_len: int
    contexts: tuple[int, ...] = CONTEXT_MIX


@dataclass
class Row:
    model: str
    mode: str
    batch: int
    mean_context: int
    tokens_per_s: float | None = None
    step_ms: float | None = None  # end to end, per step = per token of each sequence
    forward_ms: float | None = None
    bound_step_ms: float | None = None
    kernels_per_step: float | None = None
    verify_ratio: dict[int, float] = field(default_factory=dict)  # k -> verify(k + 1) forward ÷ decode forward
    note: str = ""

    @property
    def fraction_of_bound(self) -> float | None:
        return None if self.step_ms is None or self.bound_step_ms is None else self.bound_step_ms / self.step_ms

    @property
    def forward_fraction_of_bound(self) -> float | None:
        return None if self.forward_ms is None or self.bound_step_ms is None else self.bound_step_ms / self.forward_ms


def batch_contexts(batch: int, mix: tuple[int, ...] = CONTEXT_MIX) -> list[int]:
    return [mix[i % len(mix)] for i in range(batch)]


def mean_context(batch: int, plan: Plan) -> int:
    return round(sum(batch_contexts(batch, plan.contexts)) / batch)


def model_args(shape: dict[str, Any]) -> Any:
    from serving.engine.model import ModelArgs

    return ModelArgs.from_hf_config({"model_type": "llama", "architectures": ["LlamaForCausalLM"], **shape})


def parameter_count(shape: dict[str, Any]) -> int:
    """Parameters of an untied Llama of this shape (embedding, layers, final norm, lm_head)."""
    a = model_args(shape)
    attention = a.dim * (a.n_heads + 2 * a.n_kv_heads) * a.head_dim + a.n_heads * a.head_dim * a.dim
    mlp = 3 * a.dim * a.intermediate_size
    return 2 * a.vocab_size * a.dim + a.n_layers * (attention + mlp + 2 * a.dim) + a.dim


def kv_bytes_read(shape: dict[str, Any], contexts: list[int], element_size: int) -> int:
    """K and V of every layer for every cached token of the batch: what a decode step's attention reads."""
    a = model_args(shape)
    return 2 * a.n_layers * a.n_kv_heads * a.head_dim * element_size * sum(contexts)


def bound_step_s(step_weight_bytes: int, kv_bytes: int, batch: int, copy_bytes_per_s: float) -> float:
    """The fastest a decode step can be: its weights read once, plus every sequence's K/V at batch > 1 (batch 1:
    the weights alone, the issue's yardstick), at the device's copy bandwidth."""
    return (step_weight_bytes + (kv_bytes if batch > 1 else 0)) / copy_bytes_per_s


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Weight bytes a decode step reads: every weight but the embedding table, of which it reads B rows (a tied
    table is the lm_head too, so it counts)."""
    from serving.engine.model import Transformer
    from serving.engine.quant import weight_bytes

    assert isinstance(model, Transformer)
    table = model.tok_embeddings.weight
    tied = model.output.weight is table
    return weight_bytes(model) - (0 if tied else table.numel() * table.element_size())


def build_random_model(shape: dict[str, Any], dtype: torch.dtype, device: torch.device, max_model_len: int) -> Any:
    """A Transformer of the shape with random weights made in place on the device (normal, std 0.02; norms 1)."""
    from serving.engine.model import Transformer

    with torch.device("meta"):
        model = Transformer(model_args(shape), max_model_len).to(dtype)  # no memory yet: 8B in fp32 would be 32 GB
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.build_rope(device)
    return model.eval().requires_grad_(False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes moved per second (read + written) by copies of num_bytes within the device's memory."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    times = []
    for _ in range(10):
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * num_bytes / statistics.median(times)


def timed_ms(fn: Callable[[], object], device: torch.device, repeats: int, warm: int = 3) -> float:
    """Median ms of fn (each run synchronised)."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def synthetic_batch(engine: Any, contexts: list[int], query_tokens: int) -> Any:
    """A step of len(contexts) sequences with query_tokens each after their contexts, on disjoint blocks nobody
    holds (the engine is idle), logits for every query token (as a verify step)."""
    from serving.engine.batch import SequenceInput

    bs, first, seqs = engine.block_size, 0, []
    for ctx in contexts:
        n = -(-(ctx + query_tokens) // bs)
        seqs.append(SequenceInput([1] * query_tokens, ctx, list(range(first, first + n)), list(range(query_tokens))))
        first += n
    return engine.runner.builder.build(seqs)


def forward_ms(engine: Any, contexts: list[int], query_tokens: int, repeats: int) -> float:
    """Median ms of a step's forward and lm_head as the engine runs it (compiled bucket or eager)."""
    with torch.inference_mode():
        batch = synthetic_batch(engine, contexts, query_tokens)
        return timed_ms(lambda: engine.model.compute_logits(engine.runner.run_forward(batch), batch.logits_index),
                        engine.device, repeats)


def count_kernels(step: Callable[[], object], steps: int, device: torch.device) -> float | None:
    """Device kernels (and copies) per call of step, from torch.profiler; None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
    return round(kernels / steps, 1)


def end_to_end(engine: Any, contexts: list[int], steps: int, vocab: int) -> tuple[float, float | None]:
    """ms per engine step once every request decodes, and kernels per step: len(contexts) greedy requests with
    random prompts of those lengths, prefilled first (not timed), then `steps` decode steps; the rest aborted."""
    from serving.engine.types import GenerationRequest, SamplingParams

    gen = torch.Generator().manual_seed(len(contexts))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    ids = [f"e2e-{i}" for i in range(len(contexts))]
    for rid, ctx in zip(ids, contexts, strict=True):
        engine.add_request(GenerationRequest(rid, torch.randint(0, vocab, (ctx,), generator=gen).tolist(), params))
    decoding: set[str] = set()
    for _ in range(sum(contexts) + 100):  # prefill (chunked) until every request has its first token
        if len(decoding) == len(ids):
            break
        decoding.update(out.request_id for out in engine.step() if out.new_token_ids)
    else:
        raise RuntimeError(f"only {len(decoding)} of {len(ids)} requests reached decoding")
    for _ in range(3):  # warm: every step from here is a decode step of the whole batch
        engine.step()
    _sync(engine.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(engine.device)
    step_ms = 1e3 * (time.perf_counter() - start) / steps
    kernels = count_kernels(engine.step, 4, engine.device)
    for rid in ids:
        engine.abort_request(rid)
    return step_ms, kernels


_BLOCK_SIZE = 16  # tokens per KV cache block, the engine's default


def make_engine(model: Any, plan: Plan, num_blocks: int) -> Any:
    from serving.engine.config import EngineConfig
    from serving.engine.engine import LLMEngine
    from serving.engine.model_runner import ModelRunner

    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[plan.dtype]
    config = EngineConfig(model="random-weights", device=plan.device, dtype=dtype, kv_block_size=_BLOCK_SIZE,
                          max_concurrency=max(plan.batches),
                          max_model_len=plan.max_model_len, max_batched_tokens=2048, enable_prefix_caching=False,
                          compile="off", cpu_weight_packing="off", cpu_decode_attention="off")
    return LLMEngine(ModelRunner(model, config, num_blocks), config)


def _bucket(n: int) -> int:
    from serving.engine.compile import BUCKETS

    return next((b for b in BUCKETS if b >= n), BUCKETS[-1])


def capture_buckets(plan: Plan) -> tuple[list[int], list[int]]:
    """The buckets the rows use: piecewise graphs for the verify steps (k + 1 tokens of each sequence of a verify
    batch), and decode steps captured whole at each batch."""
    verify = sorted({_bucket(b * (k + 1)) for b in VERIFY_BATCHES if b in plan.batches for k in plan.ks})
    return verify, sorted({_bucket(b) for b in plan.batches})


def capture(engine: Any, plan: Plan, piecewise_from: Any = None) -> Any:
    """Compile and capture the buckets the rows use, as the engine's start-up does for its own buckets; returns
    the CompiledForward, also set on the engine. piecewise_from: a CompiledForward of the same model whose
    piecewise graphs are reused (attention is outside them, so the Triton attention kernel does not change them),
    so that only the decode graphs are captured again."""
    from serving.engine.compile import CompiledForward

    verify, decode = capture_buckets(plan)
    # CPU (the dry run): graphs traced with the eager backend, no decode captured whole (no paged attention there)
    compiled = CompiledForward(engine.model, sorted({*verify, *decode}), max_decode_rows=max(plan.batches),
                               backend="inductor" if engine.device.type == "cuda" else "eager")
    compiled._decode_cache = engine.runner.cache  # as warm_up sets it: the cache the decode graphs read
    if compiled.cuda_graphs:  # as warm_up: the graphs read the cache and rope tables in place
        k_layers, v_layers = engine.runner.cache.all_layer_blocks()
        for t in [*k_layers, *v_layers, engine.model.rope_cos, engine.model.rope_sin]:
            torch._dynamo.mark_static_address(t)
    with torch.inference_mode():
        if piecewise_from is not None:
            compiled.graphs = dict(piecewise_from.graphs)
        else:
            for b in verify:
                compiled._warm_up_bucket(b, engine.runner.cache, engine.runner.builder, measure=False)
        for b in decode if compiled.whole_decode else []:
            compiled._warm_up_decode(b, engine.runner.cache, engine.runner.builder, measure=False)
    failed = [f"{d.kind} {d.tokens}: {d.note}" for d in compiled.decisions if not d.compiled]
    if failed:
        raise RuntimeError("capture failed: " + "; ".join(failed))
    engine.runner.compiled = compiled
    return compiled


def set_mode(engine: Any, mode: str, plan: Plan, piecewise_from: Any) -> Any:
    """Put the model in a mode: its kernels, and for the captured modes its graphs. Returns the CompiledForward
    (None: eager)."""
    from serving.engine.kernels.gpu_kernels import disable_triton_kernels, enable_triton_kernels

    engine.runner.compiled = None
    gc.collect()
    model = engine.model
    if mode == "eager+triton":
        enable_triton_kernels(model, engine.block_size, engine.runner.builder)
    elif mode == "captured+triton":
        # attention only: inside compiled graphs inductor already fuses the residual add with the norm
        enable_triton_kernels(model, engine.block_size, engine.runner.builder, norm=False)
    else:
        disable_triton_kernels(model, engine.runner.builder)
    if mode.startswith("captured"):
        return capture(engine, plan, piecewise_from)
    return None


# Seconds a graph takes to compile and capture before one has been measured (8B shapes, an H200's host: a guess
# that errs long, so that a mode is skipped rather than run past the budget).
_FIRST_GRAPH_S = 45.0


def measure_model(name: str, plan: Plan, bandwidth: float, deadline: float, log: Callable[[str], None]) -> list[Row]:
    device = torch.device(plan.device)
    shape = SHAPES[name]
    rows: list[Row] = []
    started = time.perf_counter()
    model = build_random_model(shape, plan.dtype, device, plan.max_model_len)
    weights = step_weight_bytes(model)
    element = torch.empty((), dtype=plan.dtype).element_size()
    widest = batch_contexts(max(plan.batches), plan.contexts)
    num_blocks = sum(-(-(c + max(plan.ks) + plan.steps + 80) // _BLOCK_SIZE) for c in widest) + 16
    engine = make_engine(model, plan, num_blocks)
    log(f"{name}: {parameter_count(shape) / 1e9:.2f}B parameters built in {time.perf_counter() - started:.1f} s")
    piecewise = None  # the captured mode's CompiledForward: its piecewise graphs serve captured+triton too
    graph_s = _FIRST_GRAPH_S
    for mode in plan.modes:
        verify, decode = capture_buckets(plan)
        graphs = (len(decode) + (0 if piecewise is not None and mode == "captured+triton" else len(verify))
                  if mode.startswith("captured") and plan.device == "cuda" else 0)
        if time.perf_counter() + graphs * graph_s > deadline:
            rows += [Row(name, mode, b, mean_context(b, plan), note="skipped: over the time budget")
                     for b in plan.batches]
            continue
        started = time.perf_counter()
        try:
            compiled = set_mode(engine, mode, plan, piecewise if mode == "captured+triton" else None)
        except Exception as exc:  # a mode that cannot run here says why in its rows; the others still run
            rows += [Row(name, mode, b, mean_context(b, plan), note=f"{type(exc).__name__}: {exc}"[:200])
                     for b in plan.batches]
            continue
        note = ""
        if compiled is not None:
            spent = time.perf_counter() - started
            graph_s = spent / max(graphs, 1)
            note = f"{len(compiled.graphs)} piecewise + {len(compiled.decode_graphs)} decode graphs, {spent:.0f} s"
            piecewise = compiled if mode == "captured" else piecewise
        for batch in plan.batches:
            contexts = batch_contexts(batch, plan.contexts)
            row = Row(name, mode, batch, mean_context(batch, plan), note=note)
            rows.append(row)
            if time.perf_counter() > deadline:
                row.note = "skipped: over the time budget"
                continue
            row.bound_step_ms = 1e3 * bound_step_s(weights, kv_bytes_read(shape, contexts, element), batch, bandwidth)
            row.forward_ms = forward_ms(engine, contexts, 1, plan.repeats)
            if batch in VERIFY_BATCHES:
                for k in plan.ks:
                    row.verify_ratio[k] = forward_ms(engine, contexts, k + 1, plan.repeats) / row.forward_ms
            row.step_ms, row.kernels_per_step = end_to_end(engine, contexts, plan.steps, model.args.vocab_size)
            row.tokens_per_s = 1e3 * batch / row.step_ms
            if compiled is not None:  # a graph whose guards refused a step ran eagerly from then on: say so
                lost = ([f"piecewise {b}" for b in verify if b not in compiled.graphs]
                        + [f"decode {b}" for b in decode if compiled.whole_decode and b not in compiled.decode_graphs])
                row.note += f"; refused while running: {', '.join(lost)}" if lost else ""
            log(format_row(row))
    engine.runner.compiled = None
    engine.close()
    del engine, model, piecewise
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


COLUMNS = ("model", "mode", "batch", "ctx", "tok/s", "ms/step", "fwd ms", "% bound", "fwd % bound", "kernels/step",
           "verify/decode k=", "note")


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_row(row: Row) -> str:
    return " | ".join(format_cells(row))


def format_cells(row: Row) -> list[str]:
    fraction, forward_fraction = row.fraction_of_bound, row.forward_fraction_of_bound
    ratios = "/".join(_fmt(row.verify_ratio.get(k), 2) for k in sorted(row.verify_ratio)) or "-"
    return [row.model, row.mode, str(row.batch), str(row.mean_context), _fmt(row.tokens_per_s, 1),
            _fmt(row.step_ms, 2), _fmt(row.forward_ms, 2), _fmt(None if fraction is None else 100 * fraction, 1),
            _fmt(None if forward_fraction is None else 100 * forward_fraction, 1), _fmt(row.kernels_per_step, 0),
            ratios, row.note]


def format_table(rows: list[Row], header: str, ks: list[int]) -> str:
    """One markdown table, as docs/engine.md records it."""
    columns = [c + "/".join(map(str, ks)) if c.endswith("k=") else c for c in COLUMNS]
    lines = [header, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(format_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[Plan, Path | None]:
    parser = argparse.ArgumentParser(prog="python -m infra.bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="8b,1b", help="of: " + ", ".join(SHAPES) + " (default: %(default)s)")
    parser.add_argument("--modes", default=",".join(MODES), help="of: " + ", ".join(MODES) + " (default: %(default)s)")
    parser.add_argument("--batches", default="1,16,64", help="(default: %(default)s)")
    parser.add_argument("--ks", default=",".join(map(str, VERIFY_KS)), help="verify drafts (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=32, help="timed engine steps per row (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=20, help="timed forwards per figure (default: %(default)s)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="skip what is left after this many seconds (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the rows here (default: reports/gpu-check-TIME.json)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the tiny model on CPU, batches 1 and 2, the smallest k: checks that it runs")
    args = parser.parse_args(argv)

    def ints(text: str, what: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            parser.error(f"--{what}: want comma-separated integers, got {text!r}")
        if any(v < 1 for v in values):
            parser.error(f"--{what}: every value must be at least 1, got {text!r}")
        return values

    models, modes = args.models.split(","), args.modes.split(",")
    for value, allowed, what in ((models, SHAPES, "models"), (modes, MODES, "modes")):
        unknown = [v for v in value if v not in allowed]
        if unknown:
            parser.error(f"--{what}: unknown {', '.join(unknown)}; want some of {', '.join(allowed)}")
    batches, ks = ints(args.batches, "batches"), ints(args.ks, "ks")
    if args.dry_run:
        plan = Plan(["tiny"], list(MODES), [1, 2], [min(ks)], steps=2, repeats=2,
                    budget_s=args.budget_s, device="cpu", dtype=torch.float32, max_model_len=256,
                    contexts=(8, 24, 40, 56))
    else:
        plan = Plan(models, modes, batches, ks, args.steps, args.repeats, args.budget_s, "cuda", torch.bfloat16,
                    max_model_len=4096)
    return plan, args.json


def main(argv: list[str] | None = None) -> int:
    plan, json_path = parse_args(argv)
    if plan.device == "cuda" and not torch.cuda.is_available():
        sys.stderr.write("gpu_check: needs a CUDA device (--dry-run runs the tiny model on CPU)\n")
        return 2
    started = time.perf_counter()
    deadline = started + plan.budget_s
    device = torch.device(plan.device)

    def log(line: str) -> None:
        sys.stderr.write(f"[{time.perf_counter() - started:6.1f} s] {line}\n")
        sys.stderr.flush()

    bandwidth = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (64 << 20))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    log(f"{name}: copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    rows: list[Row] = []
    for model in plan.models:
        rows += measure_model(model, plan, bandwidth, deadline, log)
    elapsed = time.perf_counter() - started
    header = (f"{name}, torch {torch.__version__}, copy bandwidth {bandwidth / 1e9:.1f} GB/s, {plan.dtype}, "
              f"contexts cycling {'/'.join(map(str, plan.contexts))}, {elapsed:.0f} s")
    sys.stdout.write(format_table(rows, header, plan.ks) + "\n")
    result = {"device": name, "torch": torch.__version__, "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
              "dtype": str(plan.dtype).removeprefix("torch."), "contexts": list(plan.contexts),
              "elapsed_s": round(elapsed, 1),
              "params": {m: parameter_count(SHAPES[m]) for m in plan.models},
              "rows": [{**asdict(row), "fraction_of_bound": row.fraction_of_bound,
                        "forward_fraction_of_bound": row.forward_fraction_of_bound} for row in rows]}
    if json_path is None:
        json_path = Path("reports") / f"gpu-check-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
