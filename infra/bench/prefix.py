"""Time to first token with and without prefix caching, for requests that share a long system prompt.

Every request is one shared system prompt (1,024 tokens by default) followed by its own short user turn;
output is greedy with a fixed length (EOS ignored). Requests run in a closed loop at a fixed concurrency:
a new one arrives as soon as one finishes. The same requests go through two engines that differ only in
`enable_prefix_caching`, one after the other in one run. Used by `specdeploy bench prefix`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from infra.bench.engine import default_prompts
from serving.config import CPU_KV_CACHE_BYTES, DecodeAttentionMode, WeightPacking
from serving.engine.config import EngineConfig
from serving.engine.engine import LLMEngine
from serving.engine.types import GenerationRequest, SamplingParams
from serving.stats import percentile

log = logging.getLogger(__name__)


@dataclass
class PrefixRun:
    prefix_caching: bool
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    seconds: float  # wall time of the whole run
    prompt_tokens_computed: int  # prompt tokens that went through the model
    prefix_cache_hit_rate: float  # hits / queries, in tokens


@dataclass
class PrefixBenchReport:
    model: str
    device: str
    threads: int
    system_prompt_tokens: int
    user_tokens: list[int]  # length of each request's own part
    requests: int
    concurrency: int
    output_len: int
    runs: list[PrefixRun] = field(default_factory=list)
    ttft_p50_on_over_off: float = 0.0  # goal <= 1/3
    outputs_identical: bool = False
    weight_packing: list[dict[str, Any]] = field(default_factory=list)  # the engines' PackingDecision (same config)
    decode_attention: list[dict[str, Any]] = field(default_factory=list)  # their AttentionDecision (same config)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def system_prompt(tokenizer: Any | None, vocab_size: int, length: int) -> list[int]:
    """`length` tokens of held-out demo code (repeated as needed) with a tokenizer; fixed random ids without."""
    ids: list[int] = []
    if tokenizer is not None:
        try:
            from serving.demo import load_prompts

            text = "\n\n".join(p.prompt for p in load_prompts("code"))
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        except (ImportError, FileNotFoundError, ValueError):
            log.info("demo prompts unavailable; using a synthetic system prompt")
    if not ids:
        ids = torch.randint(1, vocab_size, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    return (ids * (length // len(ids) + 1))[:length]


def run_closed_loop(
    engine: LLMEngine, prompts: list[list[int]], concurrency: int, output_len: int, tag: str
) -> tuple[list[float], list[float], list[list[int]]]:
    """TTFT and E2E per request, and its tokens, keeping `concurrency` requests in flight."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ttft: list[float] = []
    e2e: list[float] = []
    tokens: dict[str, list[int]] = {}
    submitted = 0

    def submit() -> None:
        nonlocal submitted
        rid = f"{tag}-{submitted}"
        tokens[rid] = []
        engine.add_request(GenerationRequest(rid, prompts[submitted], params))
        submitted += 1

    while submitted < min(concurrency, len(prompts)):
        submit()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                done = time.monotonic()
                first = out.first_token_time if out.first_token_time is not None else done
                ttft.append(first - out.arrival_time)
                e2e.append(done - out.arrival_time)
                if submitted < len(prompts):
                    submit()
    return ttft, e2e, [tokens[f"{tag}-{i}"] for i in range(len(prompts))]


def run_prefix_benchmark(
    model_dir: Path,
    requests: int = 16,
    concurrency: int = 1,
    system_tokens: int = 1024,
    output_len: int = 32,
    threads: int | str = "auto",
    device: str = "cpu",
    weight_packing: WeightPacking = "auto",
    decode_attention: DecodeAttentionMode = "auto",
) -> PrefixBenchReport:
    if requests < 1 or concurrency < 1 or system_tokens < 1 or output_len < 1:
        raise ValueError("requests, concurrency, system prompt tokens and output length must all be positive")
    engines = {}
    for caching in (False, True):
        config = EngineConfig(model=str(model_dir), device=device, kv_cache_bytes=CPU_KV_CACHE_BYTES,
                              max_concurrency=max(concurrency, 1), max_batched_tokens=2048, num_threads=threads,
                              enable_prefix_caching=caching, cpu_weight_packing=weight_packing,
                              cpu_decode_attention=decode_attention)
        engines[caching] = LLMEngine.from_config(config)
    engine = engines[True]
    user = [p[-48:] for p in default_prompts(model_dir, engine.tokenizer, count=requests)]
    user = [user[i % len(user)] for i in range(requests)]
    system = system_prompt(engine.tokenizer, engine.args.vocab_size, system_tokens)
    if system_tokens + max(len(u) for u in user) + output_len > engine.max_model_len:
        raise ValueError(f"system prompt ({system_tokens}) + user turn + output ({output_len}) exceeds the "
                         f"model's context of {engine.max_model_len} tokens")
    prompts = [system + u for u in user]
    report = PrefixBenchReport(model=str(model_dir), device=str(engine.device), threads=torch.get_num_threads(),
                               system_prompt_tokens=system_tokens, user_tokens=[len(u) for u in user],
                               requests=requests, concurrency=concurrency, output_len=output_len,
                               weight_packing=[asdict(d) for d in engine.runner.weight_packing],
                               decode_attention=[asdict(d) for d in engine.runner.decode_attention])
    # warm-up on an unrelated prompt of the same shape: allocator and kernels, not the cache under test
    warm = [[(t + 7) % engine.args.vocab_size for t in prompts[0]]]
    outputs = {}
    for caching, eng in engines.items():
        run_closed_loop(eng, warm, 1, 4, "warm")
        before = eng.stats()
        started = time.perf_counter()
        ttft, e2e, outputs[caching] = run_closed_loop(eng, prompts, concurrency, output_len, "run")
        seconds = time.perf_counter() - started
        after = eng.stats()
        queries = after.prefix_cache_queries_total - before.prefix_cache_queries_total
        hits = after.prefix_cache_hits_total - before.prefix_cache_hits_total
        report.runs.append(PrefixRun(
            prefix_caching=caching,
            ttft_p50_s=percentile(ttft, 50) or 0.0,
            ttft_p99_s=percentile(ttft, 99) or 0.0,
            e2e_p50_s=percentile(e2e, 50) or 0.0,
            seconds=seconds,
            prompt_tokens_computed=after.prompt_tokens_total - before.prompt_tokens_total,
            prefix_cache_hit_rate=hits / queries if queries else 0.0,
        ))
        log.info("prefix caching %s: TTFT P50 %.1f ms", "on" if caching else "off", report.runs[-1].ttft_p50_s * 1e3)
    off, on = report.runs
    report.ttft_p50_on_over_off = on.ttft_p50_s / off.ttft_p50_s if off.ttft_p50_s else 0.0
    report.outputs_identical = outputs[True] == outputs[False]
    return report
