"""Batch-1 decode speed against the memory-bandwidth bound, on a GPU host.

The guide's rule of thumb: one decode step reads every weight once, so a single stream
cannot beat ``HBM bandwidth ÷ weight bytes`` tokens/s. This measures both sides in one run:
the device's copy bandwidth (a large device-to-device copy: bytes read + written per second)
and our engine's batch-1 greedy decode tokens/s on a randomly initialised ~1B Llama in bf16,
and prints JSON with their ratio. Run it with ``make gpu-check`` (needs CUDA; nothing else
depends on it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from serving.engine.config import EngineConfig
from serving.engine.engine import LLMEngine
from serving.engine.types import GenerationRequest, SamplingParams

# ~1.1B parameters: TinyLlama-like shape.
ONE_B: dict[str, Any] = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)


def copy_bandwidth(num_bytes: int = 2 << 30, repeats: int = 20) -> float:
    """Bytes moved per second by a device-to-device copy (each copy reads and writes num_bytes)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * num_bytes * repeats / (time.perf_counter() - start)


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


def decode_tokens_per_s(model_dir: Path, new_tokens: int) -> float:
    engine = LLMEngine.from_config(EngineConfig(model=str(model_dir), dtype="bf16", device="cuda",
                                                max_num_seqs=1, max_model_len=1024))
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
    return produced / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write("bandwidth: needs a CUDA device\n")
        return 2
    bandwidth = copy_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        params = build_random_model(Path(tmp))
        weight_bytes = params * 2
        tokens_per_s = decode_tokens_per_s(Path(tmp), args.new_tokens)
    bound = bandwidth / weight_bytes
    result = {
        "device": torch.cuda.get_device_name(),
        "params": params,
        "weight_bytes": weight_bytes,
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "bound_tokens_per_s": round(bound, 1),
        "engine_batch1_tokens_per_s": round(tokens_per_s, 1),
        "fraction_of_bound": round(tokens_per_s / bound, 3),
    }
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
