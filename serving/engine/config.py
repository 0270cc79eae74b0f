"""Engine configuration: what the server's config file (model/scheduler/speculative) maps onto."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

DType = Literal["fp32", "bf16", "fp16", "float32", "bfloat16", "float16", "auto"]


@dataclass
class SpeculativeConfig:
    enabled: bool = False
    method: Literal["draft", "ngram"] = "ngram"
    draft_model: str | None = None  # path of a Llama-family checkpoint sharing the target's tokenizer
    num_draft_tokens: int = 4  # k (fixed mode) or the largest k the adaptive policy may choose
    adaptive: bool = True  # choose k per step from measured costs and acceptance; False = always k
    ngram_min: int = 1  # n-gram proposer: shortest suffix to match
    ngram_max: int = 4  # n-gram proposer: longest suffix to match

    def validate(self) -> None:
        if self.method not in ("draft", "ngram"):
            raise ValueError(f"speculative.method must be 'draft' or 'ngram', got {self.method!r}")
        if self.enabled and self.method == "draft" and not self.draft_model:
            raise ValueError("speculative.draft_model is required when method is 'draft'")
        if not 1 <= self.num_draft_tokens <= 16:
            raise ValueError(f"speculative.num_draft_tokens must be in [1, 16], got {self.num_draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("speculative.ngram_min must be >= 1 and <= ngram_max")


@dataclass
class EngineConfig:
    model: str  # directory with config.json and *.safetensors (and a tokenizer, optional)
    dtype: DType = "auto"  # auto: the checkpoint's dtype on CUDA, fp32 on CPU
    device: str = "auto"  # auto: cuda when available, else cpu
    tokenizer: str | None = None  # defaults to the model directory
    kv_block_size: int = 16
    kv_cache_bytes: int | None = None  # explicit KV budget (CPU default 256 MiB)
    max_memory_utilization: float = 0.85  # CUDA: fraction of device memory for weights + KV + activations
    max_num_seqs: int = 64  # running sequences at most (the server's max_concurrency)
    max_num_batched_tokens: int = 512  # tokens per forward (prefill chunks + decode + verify tokens)
    max_model_len: int | None = None  # prompt + output at most; default: the model's max positions
    max_queue: int = 128  # waiting requests at most; beyond that admission answers "queue full"
    seed: int = 0  # seeds generators of requests that bring no seed
    num_threads: int | None = None  # CPU: torch intra-op threads (process-wide); None leaves torch's default
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def validate(self) -> None:
        if self.kv_block_size < 1 or self.kv_block_size & (self.kv_block_size - 1):
            raise ValueError(f"kv_block_size must be a power of two, got {self.kv_block_size}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if not 0.0 < self.max_memory_utilization <= 1.0:
            raise ValueError(f"max_memory_utilization must be in (0, 1], got {self.max_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token each)")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        self.speculative.validate()
