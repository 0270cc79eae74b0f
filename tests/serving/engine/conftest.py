"""Tiny randomly initialised checkpoints (saved the way Hugging Face saves them) and ways to run engines."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from serving.engine.batch import SequenceInput, build_forward_batch
from serving.engine.config import EngineConfig, SpeculativeConfig
from serving.engine.engine import LLMEngine
from serving.engine.kv_cache import BlockManager, KVCache
from serving.engine.loader import load_model
from serving.engine.model import Transformer
from serving.engine.types import GenerationRequest, SamplingParams

VOCAB = 128


def save_tiny_model(path: Path, model_type: str = "llama", **overrides: Any) -> Path:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
        initializer_range=0.1,  # logits spread enough that greedy argmax is not decided by rounding
    )
    common.update(overrides)
    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }
    config_cls, model_cls = classes[model_type]
    torch.manual_seed(0)
    model = model_cls(config_cls(**common))
    with torch.no_grad():  # biases start at zero; give them values so the q/k/v bias path is exercised
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    return path


def random_prompts(lengths: list[int], vocab: int = 128, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@functools.cache
def kernel_mode() -> str:
    """`on` where the CPU attention kernel builds or loads here, else `off` (a host without a compiler or a
    writable cache still runs the engine tests; test_cpu_attention.py skips there and says why)."""
    from serving.engine.kernels import cpu_attention

    try:
        cpu_attention.load()
    except cpu_attention.KernelUnavailable:
        return "off"
    return "on"


def make_engine(model_dir: Path, **overrides: object) -> LLMEngine:
    # plain nn.Linear unless a test asks for packing: `auto` measures at start-up and could go either way for a
    # tiny model; tests/serving/engine/kernels/test_cpu_linear.py runs the packed path (and once ran this whole
    # suite so)
    settings: dict[str, object] = {"kv_cache_bytes": 8 * 2**20, "max_batched_tokens": 128, "max_concurrency": 32,
                                   "cpu_weight_packing": "off"}
    # the CPU decode-attention kernel without the start-up timing (auto could go either way for a tiny model), so
    # every engine test runs the path production CPUs take; tensor-parallel engines attend gathered (the kernel is
    # refused there by name). tests/serving/engine/kernels/test_cpu_attention.py covers auto, off and the refusals
    tp = int(overrides.get("tensor_parallel_size", 1))  # type: ignore[call-overload]
    settings["cpu_decode_attention"] = (kernel_mode() if tp == 1 and overrides.get("device", "cpu") == "cpu"
                                        else "auto")
    # likewise the draft rollout (compiled at start-up: ~10-60 s a draft engine) unless a test sets it, and
    # where a test does, its Python wrapper unless the test sets that too (the C++ one adds ~30 s a graph the first
    # time); tests/serving/engine/spec/test_rollout.py runs both
    spec = overrides.get("speculative")
    defaults = {"draft_rollout": "off", "draft_rollout_wrapper": "python"}
    if isinstance(spec, SpeculativeConfig):
        overrides["speculative"] = spec.model_copy(
            update={k: v for k, v in defaults.items() if k not in spec.model_fields_set})
    elif isinstance(spec, dict):
        overrides["speculative"] = {**defaults, **spec}
    return LLMEngine.from_config(EngineConfig(model=str(model_dir), **{**settings, **overrides}))


def run_to_completion(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    after_step: Callable[[LLMEngine], None] | None = None,
) -> list[list[int]]:
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(GenerationRequest(str(i), prompt, p))
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        if after_step is not None:
            after_step(engine)
    return [got[str(i)] for i in range(len(prompts))]


class PagedRunner:
    """Drives the bare model over a paged cache with hand-made step layouts."""

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.model: Transformer = load_model(model_dir, dtype, self.device, 512)
        a = self.model.args
        self.cache = KVCache(a.n_layers, 96, 16, a.n_kv_heads, a.head_dim, dtype, self.device)
        self.blocks = BlockManager(96, 16)

    @torch.inference_mode()
    def step(self, prompts: list[list[int]], spec: list[tuple[int, int, int]]) -> torch.Tensor:
        """spec: (sequence, start, count) per scheduled sequence; returns logits of every scheduled token."""
        seqs = []
        for sid, start, n in spec:
            self.blocks.allocate(str(sid), start + n)
            seqs.append(SequenceInput(prompts[sid][start : start + n], start, self.blocks.block_table(str(sid)),
                                      list(range(n))))
        dtype = self.model.tok_embeddings.weight.dtype
        batch = build_forward_batch(seqs, 16, self.model.args.n_rep, self.device, dtype)
        return self.model.compute_logits(self.model(batch, self.cache), batch.logits_index)


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models on a shared 2-core machine: one thread is several times faster than two that wait."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2")


def both_attention_paths(runner: PagedRunner, seqs: list[SequenceInput]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of every scheduled token through gather + SDPA, then through the paged path (same K/V written)."""
    model = runner.model
    out = []
    for paged in (False, True):
        model.set_paged_attention(paged)
        batch = build_forward_batch(seqs, 16, model.args.n_rep, runner.device)
        with torch.inference_mode():
            out.append(model.compute_logits(model(batch, runner.cache), batch.logits_index))
    model.set_paged_attention(False)
    return out[0], out[1]


class EngineTestKit:
    """The helpers above as one fixture (tests cannot import conftest under --import-mode=importlib)."""

    save_tiny_model = staticmethod(save_tiny_model)
    random_prompts = staticmethod(random_prompts)
    make_engine = staticmethod(make_engine)
    run_to_completion = staticmethod(run_to_completion)
    PagedRunner = PagedRunner
    both_attention_paths = staticmethod(both_attention_paths)


@pytest.fixture(scope="session")
def kit() -> type[EngineTestKit]:
    return EngineTestKit
