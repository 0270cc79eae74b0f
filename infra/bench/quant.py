"""What int8 weights cost and save: held-out perplexity, weight bytes and engine tokens/s, fp32 beside int8.

Perplexity runs through the engine's own model (paged attention, quantized matmuls), teacher-forced over
non-overlapping windows of the demo's held-out code (the text serving/demo/evaluate.py scores). Tokens/s
is `bench engine`'s closed loop (greedy, EOS ignored, fixed prompts) on two engines, rounds interleaved and
the best of each kept. Used by `specdeploy bench engine --quantization int8`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from infra.bench.engine import bench_engine, default_prompts
from serving.config import CPU_KV_CACHE_BYTES, Quantization
from serving.engine.batch import SequenceInput, build_forward_batch
from serving.engine.config import EngineConfig
from serving.engine.engine import LLMEngine
from serving.engine.kv_cache import KVCache
from serving.engine.loader import load_model
from serving.engine.model import Transformer
from serving.engine.quant import weight_bytes

_BLOCK = 16


@dataclass
class QuantBenchReport:
    model: str
    quantization: str  # the method measured against the unquantized model
    threads: int
    window: int  # tokens per scored window
    heldout_tokens: int  # tokens scored (0: the model has no tokenizer or there is no held-out text)
    perplexity: dict[str, float] = field(default_factory=dict)  # "none" / method -> held-out perplexity
    perplexity_relative_gap: float | None = None  # (quantized - none) / none
    weight_bytes: dict[str, int] = field(default_factory=dict)  # "none" / method -> bytes of weights in memory
    weight_ratio: float = 0.0  # quantized / none (goal <= 0.3 for int8 against fp32)
    tokens_per_s: dict[str, dict[int, float]] = field(default_factory=dict)  # "none" / method -> c -> tokens/s
    output_len: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def heldout_windows(model_dir: Path, length: int, limit: int) -> torch.Tensor:
    """[n, length + 1] windows of the demo's held-out code, encoded with the model's tokenizer ([0, 0] if none)."""
    from transformers import AutoTokenizer

    from serving.demo import corpus
    from serving.demo.training import encode_files, fixed_windows

    files = corpus.committed_heldout()
    if not files or not (model_dir / "tokenizer.json").is_file():
        return torch.empty(0, length + 1, dtype=torch.long)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return fixed_windows(encode_files(tokenizer, files), length, limit)


@torch.inference_mode()
def mean_nll(model: Transformer, windows: torch.Tensor, batch: int = 8) -> float:
    """Mean next-token negative log-likelihood of [n, L + 1] windows, each a fresh sequence in the paged cache."""
    n_ctx = windows.shape[1] - 1
    blocks_per_seq = -(-n_ctx // _BLOCK)
    a = model.args
    cache = KVCache(a.n_layers, batch * blocks_per_seq, _BLOCK, a.n_kv_heads, a.head_dim, model.dtype, model.device)
    total, count = 0.0, 0
    for chunk in windows.split(batch):
        seqs = [SequenceInput(row[:-1].tolist(), 0, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                              list(range(n_ctx))) for i, row in enumerate(chunk)]
        fb = build_forward_batch(seqs, _BLOCK, a.n_rep, model.device, model.dtype)
        logits = model.compute_logits(model(fb, cache), fb.logits_index)  # [chunk * L, vocab]
        labels = chunk[:, 1:].reshape(-1).to(model.device)
        total += F.cross_entropy(logits, labels, reduction="sum").item()
        count += labels.numel()
    return total / count


def run_quant_benchmark(
    model_dir: Path, method: Quantization, concurrencies: list[int], output_len: int, threads: int, repeats: int = 2,
    window: int = 256, max_windows: int = 64,
) -> QuantBenchReport:
    torch.set_num_threads(threads)
    methods: tuple[Quantization, ...] = ("none", method)
    report = QuantBenchReport(model=str(model_dir), quantization=method, threads=torch.get_num_threads(),
                              window=window, heldout_tokens=0, output_len=output_len)
    windows = heldout_windows(model_dir, window, max_windows)
    for m in methods:
        model = load_model(model_dir, torch.float32, torch.device("cpu"), window + 1, m)
        report.weight_bytes[m] = weight_bytes(model)
        if len(windows):
            report.perplexity[m] = round(math.exp(mean_nll(model, windows)), 4)
        del model
    report.heldout_tokens = int(windows[:, 1:].numel())
    report.weight_ratio = round(report.weight_bytes[method] / report.weight_bytes["none"], 4)
    if report.perplexity:
        base = report.perplexity["none"]
        report.perplexity_relative_gap = round((report.perplexity[method] - base) / base, 5)
    max_c = max(concurrencies)
    engines = {
        m: LLMEngine.from_config(EngineConfig(
            model=str(model_dir), device="cpu", dtype="fp32", quantization=m,
            kv_cache_bytes=CPU_KV_CACHE_BYTES, max_concurrency=max_c, max_batched_tokens=max(512, max_c),
            num_threads=threads))
        for m in methods
    }
    prompts = default_prompts(model_dir, engines["none"].tokenizer)
    for engine in engines.values():
        bench_engine(engine, prompts, 2, 8)  # warm-up
    best: dict[str, dict[int, float]] = {m: {} for m in methods}
    for _ in range(max(repeats, 1)):  # interleaved: a busy minute on a shared machine hits both alike
        for c in concurrencies:
            for m, engine in engines.items():
                tps = bench_engine(engine, prompts, c, output_len).tokens_per_s
                best[m][c] = round(max(best[m].get(c, 0.0), tps), 1)
    report.tokens_per_s = best
    return report
