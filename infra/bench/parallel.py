"""Decode tokens/s of one model at several tensor_parallel_size values, measured one after another in one run.

    python -m infra.bench.parallel --model serving/demo/models/target --tp 1 2

Information, not a goal: on a CPU every rank shares the same cores and memory bandwidth, and each layer adds
two all-reduces over loopback, so tp > 1 is expected to be slower there. Read the ratio, not the absolute
numbers, on a busy machine.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from infra.bench.engine import bench_engine, default_prompts
from serving.engine.config import EngineConfig
from serving.engine.engine import LLMEngine


def run_tp_benchmark(model_dir: Path, tps: Sequence[int], concurrency: int, output_len: int,
                     num_threads: int) -> list[tuple[int, float]]:
    """(tp, decode tokens/s) per tp: greedy, ignore_eos, the demo code prompts when the model has a tokenizer."""
    rates = []
    for tp in tps:
        engine = LLMEngine.from_config(EngineConfig(model=str(model_dir), tensor_parallel_size=tp, dtype="fp32",
                                                    device="cpu", num_threads=num_threads))
        try:
            prompts = default_prompts(model_dir, engine.tokenizer, concurrency)
            bench_engine(engine, prompts, 1, 4)  # warm-up: first-call allocations, lazy init
            rates.append((tp, bench_engine(engine, prompts, concurrency, output_len).tokens_per_s))
        finally:
            engine.close()
    return rates


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.bench.parallel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="model directory (HF layout)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor_parallel_size values")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args(argv)
    rates = run_tp_benchmark(args.model, args.tp, args.concurrency, args.output_len, args.threads)
    base = rates[0][1]
    sys.stdout.write(f"{args.model}: concurrency {args.concurrency}, {args.output_len} tokens each, "
                     f"{args.threads} thread(s) per rank, CPU (gloo)\n")
    for tp, rate in rates:
        sys.stdout.write(f"  tp={tp}: {rate:8.1f} tok/s  ({rate / base:.2f}x tp={rates[0][0]})\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
