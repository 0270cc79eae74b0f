"""Batch-1 decode speed against the memory-bandwidth bound, on a GPU host.

The guide's rule of thumb: one decode step reads every weight once, so a single stream
cannot beat ``HBM bandwidth ÷ weight bytes`` tokens/s. This measures both sides in one run:
the device's copy bandwidth (a large device-to-device copy: bytes read + written per second)
and our engine's batch-1 greedy decode tokens/s on a randomly initialised ~1B Llama in bf16,
and prints JSON with their ratio, for compiled steps with CUDA graphs ("on": decode steps captured whole,
attention included; "piecewise": attention between graph pieces) and without ("off", eager), and for int8
and fp8 weights (each run's bound uses its own weight bytes). Each run also times the forward alone (the
step's graph replay and lm_head, without scheduling or sampling), which says how much of the gap to the
bound is the engine's per-step work rather than the kernels. Run it with ``make gpu-check`` (needs CUDA;
nothing else depends on it).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from infra.bench.gpu_check import ONE_B, copy_bandwidth
from infra.bench.step_profile import profile_steps
from serving.engine.config import EngineConfig
from serving.engine.engine import LLMEngine
from serving.engine.quant import weight_bytes
from serving.engine.types import GenerationRequest, SamplingParams


def build_random_model(directory: Path) -> int:
    """Save a randomly initialised bf16 Llama; returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**ONE_B, tie_word_embeddings=False))
        model = model.bfloat16()
    model.save_pretrained(directory)
    count = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    return count


def forward_ms(engine: LLMEngine, context: int, repeats: int = 200) -> float:
    """Mean ms of a batch-1 decode forward plus lm_head at `context` cached tokens, as the engine runs it."""
    from serving.engine.batch import SequenceInput

    bs = engine.block_size
    # blocks nobody holds (the engine is idle; run last: it writes K/V into them, cached ones included)
    blocks = list(range(-(-(context + 1) // bs)))
    with torch.inference_mode():  # as the engine's steps build and run batches (the graphs' guards expect it)
        batch = engine.runner.builder.build([SequenceInput([1], context, blocks, [0])])
        for _ in range(5):
            engine.model.compute_logits(engine.runner.run_forward(batch), batch.logits_index)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            engine.model.compute_logits(engine.runner.run_forward(batch), batch.logits_index)
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / repeats


def kernel_profile(engine: LLMEngine, prompt: list[int], steps: int = 32, top: int = 12) -> dict[str, Any]:
    """The device kernels of `steps` batch-1 decode steps, from torch.profiler: kernels (and copies) per step,
    device-busy ms per step against the step's wall ms (the rest is the host and launch gaps), and the
    kernels that take the most time, by name, and the CUDA calls and aten ops the host makes per step (what a
    step launches outside its graphs). Kernels replayed from a CUDA graph are listed one by one."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    engine.add_request(GenerationRequest("kernel-profile", prompt, SamplingParams(
        temperature=0.0, max_tokens=steps + 1, ignore_eos=True)))
    engine.step()  # prefill and the first token
    torch.cuda.synchronize()
    done = 0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            done += 1
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    per_name: dict[str, list[float]] = {}
    cuda_calls: dict[str, int] = {}  # CUDA runtime/driver calls the host makes (launches, copies, graph replays)
    aten_ops: dict[str, int] = {}  # ... and the aten ops it runs, views included
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            per_name.setdefault(event.name, []).append(event.time_range.elapsed_us())
        elif event.name.startswith("cu"):
            cuda_calls[event.name] = cuda_calls.get(event.name, 0) + 1
        elif event.name.startswith("aten::"):
            aten_ops[event.name] = aten_ops.get(event.name, 0) + 1

    def per_step(counts: dict[str, int], most: int) -> dict[str, float]:
        ranked = sorted(counts.items(), key=lambda item: -item[1])[:most]
        return {name: round(count / max(done, 1), 1) for name, count in ranked}
    busy_us = sum(sum(times) for times in per_name.values())
    ranked = sorted(per_name.items(), key=lambda item: -sum(item[1]))
    return {
        "steps": done,
        "step_wall_ms": round(1e3 * wall / max(done, 1), 3),  # under the profiler: slower than unprofiled
        "device_busy_ms_per_step": round(busy_us / 1e3 / max(done, 1), 3),
        "kernels_per_step": round(sum(len(t) for t in per_name.values()) / max(done, 1), 1),
        "cuda_calls_per_step": per_step(cuda_calls, 10),
        "aten_ops_per_step": per_step(aten_ops, 25),
        "top_kernels": [{"name": name[:120], "per_step": round(len(times) / max(done, 1), 1),
                         "us_per_step": round(sum(times) / max(done, 1), 1),
                         "mean_us": round(sum(times) / len(times), 2)} for name, times in ranked[:top]],
    }


def decode_tokens_per_s(model_dir: Path, new_tokens: int, compile_mode: str, quantization: str,
                        kv_cache_bytes: int | None = None, profile_kernels: bool = False) -> dict[str, Any]:
    """Batch-1 greedy decode tokens/s of one engine configuration, with what its start-up did.

    compile_mode: on (decode captured whole), piecewise (graphs between attention calls), off (eager)."""
    from torch._dynamo.utils import counters

    counters.clear()
    started = time.perf_counter()
    engine = LLMEngine.from_config(EngineConfig(
        model=str(model_dir), dtype="bf16", device="cuda", max_concurrency=1, max_model_len=1024,
        compile="off" if compile_mode == "piecewise" else compile_mode, quantization=quantization,
        **({"kv_cache_bytes": kv_cache_bytes} if kv_cache_bytes else {})))
    if compile_mode == "piecewise":
        engine.runner.compile_steps(whole_decode=False)
    startup_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    prompt = list(range(1, 17))
    for warm in range(2):  # first runs pay for kernel selection and allocator growth
        engine.add_request(GenerationRequest(f"warm-{warm}", prompt, SamplingParams(temperature=0.0, max_tokens=8,
                                                                                    ignore_eos=True)))
        while engine.has_unfinished_requests():
            engine.step()
    engine.add_request(GenerationRequest("timed", prompt, params))
    engine.step()  # prefill and the first token are not decode
    torch.cuda.synchronize()
    start = time.perf_counter()
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(len(out.new_token_ids) for out in engine.step())
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    # where a step's time goes (each phase synchronizes the device, so these steps run a little slower)
    engine.add_request(GenerationRequest("profiled", prompt, SamplingParams(temperature=0.0, max_tokens=64,
                                                                            ignore_eos=True)))
    engine.step()

    def finish() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    split = profile_steps(engine, finish, concurrency=1)
    kernels = kernel_profile(engine, prompt) if profile_kernels else None
    forward = forward_ms(engine, context=len(prompt) + new_tokens // 2)
    compiled = engine.runner.compiled
    result = {
        "compile": compile_mode,
        "quantization": quantization,
        "weight_bytes": weight_bytes(engine.model),
        "startup_s": round(startup_s, 1),
        "kv_cache_blocks": engine.runner.cache.num_blocks,
        "compiled_buckets": sorted(compiled.graphs) if compiled is not None else [],
        "whole_decode_buckets": sorted(compiled.decode_graphs) if compiled is not None else [],
        "cuda_graphs": bool(compiled is not None and compiled.cuda_graphs),
        "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0)),
        "tokens_per_s": round(produced / elapsed, 1),
        "ms_per_token": round(1e3 * elapsed / produced, 3),
        "forward_ms": round(forward, 3),  # graph replay (or eager forward) + lm_head, no scheduling/sampling
        "profiled_step_ms": {phase: round(getattr(split, f"{phase}_ms"), 3)
                             for phase in ("step", "python", "attention", "matmuls", "sampling")},
        **({"kernels": kernels} if kernels is not None else {}),
        "compile_decisions": [f"{d.kind} {d.tokens}: " + (d.note or ("compiled" if d.compiled else "eager"))
                              for d in (compiled.decisions if compiled is not None else [])],
    }
    engine.close()
    return result


CONFIGS = ("on:none", "piecewise:none", "off:none", "on:int8", "on:fp8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="KV cache size (default: the engine's, most of the free device memory)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="compile:quantization pairs, comma-separated (default: %(default)s)")
    parser.add_argument("--profile", action="store_true",
                        help="also list each run's device kernels per decode step (torch.profiler)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write("bandwidth: needs a CUDA device\n")
        return 2
    configs = [tuple(c.split(":")) for c in args.configs.split(",")]
    for config in configs:
        if len(config) != 2 or config[0] not in ("on", "piecewise", "off", "auto") \
                or config[1] not in ("none", "int8", "fp8"):
            sys.stderr.write(f"bandwidth: bad --configs entry {':'.join(config)!r}: want compile:quantization, "
                             "e.g. on:none or off:int8\n")
            return 2
    bandwidth = copy_bandwidth(torch.device("cuda"), 2 << 30)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        params = build_random_model(Path(tmp))
        for compile_mode, quantization in configs:
            kv_bytes = int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else None
            run = decode_tokens_per_s(Path(tmp), args.new_tokens, compile_mode, quantization, kv_bytes,
                                      profile_kernels=args.profile)
            gc.collect()  # the run's engine and its KV cache
            torch.cuda.empty_cache()
            # the bound of each run is its own weight bytes: quantized weights are fewer bytes to read per token
            run["bound_tokens_per_s"] = round(bandwidth / run["weight_bytes"], 1)
            run["fraction_of_bound"] = round(run["tokens_per_s"] / run["bound_tokens_per_s"], 3)
            run["forward_fraction_of_bound"] = round(1e3 / run["forward_ms"] / run["bound_tokens_per_s"], 3)
            runs.append(run)
            sys.stderr.write(json.dumps(run) + "\n")
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "params": params,
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "runs": runs,
    }
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
