"""The build step: from an EngineConfig to a loaded, sized and tuned model runner (LLMEngine.from_config).

`load` bounds oneDNN's primitive caches (before the first primitive: kernels/primitive_cache.py), reads the
weights in the dtype it resolves (and starts the tensor-parallel ranks), sizes the KV cache and builds the
proposer; `tune` then takes every other decision the engine makes by itself, in this order:

    threads → draft rollout → weight packing → decode attention → compile

the thread count first, because every later choice is measured on those threads; the draft's rollout before
packing, because it is compiled and measured on the plain weights it needs; compiling last, on the weights
and attention the choices before it left. tune returns each decision as (setting, what was chosen, why): the
one "start-up decisions:" log line, and what the benchmarks print beside their figures.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from serving.config import CPU_KV_CACHE_BYTES
from serving.engine import huge_pages
from serving.engine.config import EngineConfig
from serving.engine.cpu_threads import choose as choose_threads
from serving.engine.cpu_threads import usable_cores
from serving.engine.kernels import cpu_attention, cpu_linear, primitive_cache
from serving.engine.kv_cache import kv_bytes_per_block
from serving.engine.loader import dtype_reason, load_model, read_model_args, resolve_dtype
from serving.engine.model import Transformer
from serving.engine.model_runner import ModelRunner
from serving.engine.parallel.group import start_workers
from serving.engine.spec.draft import DraftModelProposer
from serving.engine.spec.ngram import NgramProposer
from serving.engine.spec.proposer import Proposer
from serving.engine.spec.speculator import Speculator

log = logging.getLogger(__name__)

Decision = tuple[str, str, str]  # (setting, what was chosen, why)

_CUDA_ACTIVATION_RESERVE = 0.10  # of the budget left after weights, kept for activations and the allocator


def load(config: EngineConfig) -> tuple[ModelRunner, Any | None, str]:
    """The target model (and its tensor-parallel ranks) in a runner with its KV cache and speculator, untuned;
    the tokenizer; and why the model's dtype resolved as it did."""
    if isinstance(config.num_threads, int):  # before loading: the load's own kernels run on these threads
        torch.set_num_threads(config.num_threads)
    if config.device == "cuda" and not torch.cuda.is_available():
        # Never fall back to CPU when the deployment asked for the GPU: stay not ready and say why.
        raise RuntimeError(f"model.device is cuda but torch {torch.__version__} (CUDA build "
                           f"{torch.version.cuda or 'none'}) finds no CUDA device: check the NVIDIA driver, "
                           "the container toolkit (--gpus all) and the image variant")
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
    )
    caches = primitive_cache.bound(device)  # before the first oneDNN primitive of the load and the tuning
    args = read_model_args(config.model)
    dtype = resolve_dtype(config.dtype, args, device)
    max_model_len = config.max_model_len or args.max_position_embeddings
    if args.sliding_window:
        max_model_len = min(max_model_len, args.sliding_window)
    tp_group = start_workers(config, args, dtype, device, max_model_len)  # None unless tensor parallel
    try:
        model = load_model(config.model, dtype, device, max_model_len, config.quantization,
                           shard=(0, config.tensor_parallel_size))
        # per device: a tensor-parallel rank holds its share of the KV heads
        per_block = kv_bytes_per_block(args.n_layers, model.args.n_kv_heads, args.head_dim,
                                       config.kv_block_size, dtype)
        num_blocks = max(kv_budget_bytes(config, device) // per_block, 1)
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, config.kv_block_size,
                 num_blocks * per_block / 2**20)
        if tp_group is not None:
            tp_group.ready(model, num_blocks)
        speculator = None
        if config.speculative.enabled:  # the draft runs on rank 0 only, unsharded
            speculator = build_speculator(config, model, dtype, device, num_blocks)
        tokenizer = load_tokenizer(config.tokenizer or config.model)
        runner = ModelRunner(model, config, num_blocks, speculator, tp_group)
        runner.primitive_caches = caches
    except BaseException:
        if tp_group is not None:
            tp_group.shutdown()
        raise
    return runner, tokenizer, dtype_reason(config.dtype, args, device)


def tune(runner: ModelRunner, config: EngineConfig, why_dtype: str) -> list[Decision]:
    """Take every start-up decision for the runner's models (the target's, and its proposer's through the
    Proposer's start-up hooks), before any request; returns them in the start-up line's order."""
    model, device = runner.model, runner.device
    tensor_parallel = runner.tp_group is not None
    proposer = runner.speculator.proposer if runner.speculator is not None else None
    # process-wide, decided once the model is loaded (auto measures it) and before every measured choice
    share = max(usable_cores() // config.tensor_parallel_size, 1) if tensor_parallel else None
    threads = choose_threads(model, config.num_threads, cores=share)
    # CPU with a draft: the rollout first (compiled and measured on the plain weights it needs), then packing
    if proposer is not None:  # serving.engine.spec.rollout
        spec = config.speculative
        runner.draft_rollout = proposer.prepare_rollout(spec.draft_rollout, spec.num_draft_tokens,
                                                        spec.draft_rollout_wrapper)
    # CPU: packing measured per model at start-up, before ready (serving.engine.kernels.cpu_linear)
    reason_not = cpu_linear.unsupported_reason(device, runner.dtype, config.quantization,
                                               compiles(config.compile, device), tensor_parallel)
    runner.weight_packing = [cpu_linear.choose(model, "target", config.cpu_weight_packing, reason_not)]
    if proposer is not None:
        runner.weight_packing += proposer.pack_weights(config.cpu_weight_packing, reason_not)
    # CPU: decode attention in place or gathered (serving.engine.kernels.cpu_attention)
    runner.decode_attention = [cpu_attention.choose_for(model, "target", runner.builder, config.cpu_decode_attention,
                                                        tensor_parallel)]
    if proposer is not None:
        runner.decode_attention += proposer.choose_attention(config.cpu_decode_attention, tensor_parallel)
    if compiles(config.compile, device) and not tensor_parallel:
        runner.compile_steps()  # part of start-up: the server reports ready only after it

    decisions = [("model.dtype", str(runner.dtype).removeprefix("torch."), why_dtype),
                 ("model.num_threads", str(threads.threads or torch.get_num_threads()), threads.reason),
                 huge_pages.describe(),
                 ("oneDNN primitive caches", *runner.primitive_caches),
                 ("model.compile", "on" if runner.compiled is not None else "off",
                  f"model.compile is {config.compile} on {device.type}")]
    decisions += [(f"model.cpu_weight_packing[{d.model}]", "packed" if d.packed else "dense", d.reason)
                  for d in runner.weight_packing]
    decisions += [(f"model.cpu_decode_attention[{d.model}]", "kernel" if d.kernel else "gather + SDPA", d.reason)
                  for d in runner.decode_attention]
    if proposer is not None:
        spec = config.speculative
        decisions.append(("speculative", f"{spec.method}, k <= {spec.num_draft_tokens}",
                          "adaptive: k per step from measured costs" if spec.adaptive else "k at every step"))
        decisions += proposer.decisions()
    return decisions


def build_speculator(
    config: EngineConfig, model: Transformer, dtype: torch.dtype, device: torch.device, num_blocks: int
) -> Speculator:
    spec = config.speculative
    proposer: Proposer
    if spec.method == "ngram":
        proposer = NgramProposer(spec.ngram_min, spec.ngram_max)
    else:
        assert spec.draft_model is not None
        # as many draft blocks as target blocks: the draft never runs out before the target does
        proposer = DraftModelProposer.load(spec.draft_model, config.model, model.args, dtype, device,
                                           model.max_model_len, num_blocks, config.kv_block_size,
                                           spec.draft_token_map, spec.draft_context)
    return Speculator(spec, proposer, model.max_model_len)


def compiles(mode: str, device: torch.device) -> bool:
    """model.compile: auto compiles on CUDA only (on CPU the start-up cost outweighs the gain, measured)."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """Bytes for the KV cache: explicit on CPU; on CUDA max_memory_utilization of the device minus what is in use."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    if device.type != "cuda":
        return CPU_KV_CACHE_BYTES
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free  # weights (already loaded) plus anything else on the device
    budget = config.max_memory_utilization * total - in_use
    if budget <= 0:
        raise RuntimeError(
            f"no memory left for the KV cache: {in_use / 2**30:.1f} GiB in use of "
            f"{config.max_memory_utilization:.2f} x {total / 2**30:.1f} GiB"
        )
    return int(budget * (1 - _CUDA_ACTIVATION_RESERVE))


def load_tokenizer(path: str | Path) -> Any | None:
    """The model's tokenizer if its directory has one (tests run tokenizer-less tiny models)."""
    directory = Path(path)
    if not (directory / "tokenizer.json").is_file() and not (directory / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))
