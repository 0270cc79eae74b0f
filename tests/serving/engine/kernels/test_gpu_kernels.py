"""The Triton kernels on the engine's CUDA path (serving.engine.kernels.gpu_kernels), run by `make gpu-test`.

With the kernels switched on, eager steps, compiled steps with CUDA graphs and decode steps captured whole give
the greedy tokens of the engine without them (fp32, where the attention paths differ by rounding only), and
speculation's verify steps, which attend through the same kernel, keep them too. The kernels themselves are
held against float64 in test_triton_kernels.py (under the interpreter on CPU, compiled on a card)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from serving.engine.types import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-test on a GPU host)"),
]

SETTINGS = {"device": "cuda", "dtype": "fp32", "max_concurrency": 4, "max_batched_tokens": 32, "compile": "off"}


def _with_kernels(kit: Any, llama_dir: Path, compile_mode: str, **overrides: Any) -> Any:
    """An engine with the Triton kernels; compile_mode: off (eager), whole (decode captured whole), piecewise."""
    from serving.engine.kernels.gpu_kernels import decode_with_new_key_op, enable_triton_kernels
    from serving.engine.model import KERNEL_MAX_QUERY

    engine = kit.make_engine(llama_dir, **{**SETTINGS, **overrides})
    enable_triton_kernels(engine.model, engine.block_size, engine.runner.builder)
    assert engine.model.captured_decode_kernel is decode_with_new_key_op
    assert engine.runner.builder.in_place_max_q == KERNEL_MAX_QUERY  # decode and verify sequences: one group
    if compile_mode != "off":
        engine.runner.compile_steps(whole_decode=compile_mode == "whole")
    return engine


@pytest.mark.parametrize("compile_mode", ["off", "whole", "piecewise"])
def test_triton_kernels_keep_the_greedy_tokens(kit: Any, llama_dir: Path, compile_mode: str) -> None:
    from torch._dynamo.utils import counters

    prompts = kit.random_prompts([3, 11, 1, 6, 20], seed=7)  # a one-token prompt: a decode-shaped prefill
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 5, 9, 17, 32)]
    plain = kit.run_to_completion(kit.make_engine(llama_dir, **SETTINGS), prompts, params)
    counters.clear()
    engine = _with_kernels(kit, llama_dir, compile_mode)
    assert kit.run_to_completion(engine, prompts, params) == plain
    assert engine.blocks.num_used == 0
    if compile_mode != "off":
        compiled = engine.runner.compiled
        assert compiled is not None and compiled.cuda_graphs
        assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])
        assert (compiled.steps_whole_decode > 20) is (compile_mode == "whole")
        assert sorted(compiled.decode_graphs) == ([1, 2, 4] if compile_mode == "whole" else [])


def test_verify_steps_through_the_kernel_keep_the_greedy_tokens(kit: Any, llama_dir: Path) -> None:
    """Speculation (n-gram, k = 3): verify groups of 4 query tokens attend through the kernel, decode steps are
    captured whole through it, with prefix caching sharing blocks between sequences."""
    from serving.engine.config import SpeculativeConfig

    system = kit.random_prompts([40], seed=11)[0]
    prompts = [system + p for p in kit.random_prompts([5, 9, 2], seed=12)]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * len(prompts)
    settings = {"enable_prefix_caching": True}
    plain = kit.run_to_completion(kit.make_engine(llama_dir, **{**SETTINGS, **settings}), prompts, params)
    spec = SpeculativeConfig(enabled=True, method="ngram", adaptive=False, num_draft_tokens=3)
    engine = _with_kernels(kit, llama_dir, "whole", speculative=spec, **settings)
    assert kit.run_to_completion(engine, prompts, params) == plain
    assert engine.stats().spec.num_draft_tokens > 0
    assert engine.blocks.num_used == 0


def test_bf16_eager_and_captured_steps_agree_with_the_kernels(kit: Any, llama_dir: Path) -> None:
    """bf16, the production precision: with the kernels, logits of a decode step captured whole and of the same
    step run eagerly agree (the dense layers round differently under inductor; attention is the same kernel)."""
    from serving.engine.batch import SequenceInput

    engine = _with_kernels(kit, llama_dir, "whole", dtype="bf16")
    prompt = kit.random_prompts([30], seed=5)[0]
    with torch.inference_mode():
        prefill = engine.runner.builder.build([SequenceInput(prompt, 0, [0, 1], [29])])
        engine.model(prefill, engine.runner.cache)
        batch = engine.runner.builder.build([SequenceInput([7], 30, [0, 1], [0])])
        captured = engine.model.compute_logits(engine.runner.run_forward(batch), batch.logits_index)
        eager = engine.model.compute_logits(engine.model(batch, engine.runner.cache), batch.logits_index)
    assert engine.runner.compiled is not None and engine.runner.compiled.steps_whole_decode == 1
    cosine = torch.nn.functional.cosine_similarity(captured, eager, dim=-1)
    assert cosine.min().item() > 0.999
    assert torch.equal(captured.argmax(-1), eager.argmax(-1))
