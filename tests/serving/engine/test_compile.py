"""Compiled small steps: bucketing, the config switch, and greedy tokens identical to the eager engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from serving.engine.compile import BUCKETS, attention_op, buckets_up_to
from serving.engine.engine import compiles
from serving.engine.types import SamplingParams


def test_buckets_cover_the_largest_step_with_one_bucket_to_spare() -> None:
    assert buckets_up_to(1) == [1]
    assert buckets_up_to(5) == [1, 2, 4, 8]
    assert buckets_up_to(32) == [1, 2, 4, 8, 16, 32]
    assert buckets_up_to(10_000) == list(BUCKETS)  # steps above the largest bucket run eagerly


@pytest.mark.parametrize(("mode", "device", "expected"), [
    ("auto", "cuda", True), ("auto", "cpu", False), ("on", "cpu", True), ("off", "cuda", False),
])
def test_compile_mode(mode: str, device: str, expected: bool) -> None:
    assert compiles(mode, torch.device(device)) is expected


def test_attention_op_outside_a_step_says_so() -> None:
    q = torch.zeros(2, 4, 8)
    with pytest.raises(RuntimeError, match="outside a compiled step"):
        attention_op(q, q[:, :2], q[:, :2], 0)


def test_compile_off_and_auto_on_cpu_run_eagerly(llama_dir: Path, kit: Any) -> None:
    for mode in ("off", "auto"):
        engine = kit.make_engine(llama_dir, compile=mode)
        assert engine.compiled is None
        prompts = kit.random_prompts([5, 9])
        assert all(len(t) == 3 for t in kit.run_to_completion(
            engine, prompts, [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)] * 2))


@pytest.mark.slow
def test_compiled_steps_give_the_eager_greedy_tokens(llama_dir: Path, kit: Any) -> None:
    # four sequences at most: buckets 1, 2 and 4 (three decoding sequences pad to 4)
    settings = {"max_num_seqs": 4, "max_num_batched_tokens": 16, "compile": "off"}
    prompts = kit.random_prompts([3, 11, 6, 20], seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 5, 9, 16)]
    eager = kit.run_to_completion(kit.make_engine(llama_dir, **settings), prompts, params)

    engine = kit.make_engine(llama_dir, **settings)
    engine.compile_steps(measure=False)  # every bucket compiled, whether or not it pays here
    assert engine.compiled is not None
    assert sorted(engine.compiled.graphs) == [1, 2, 4]
    compiled = kit.run_to_completion(engine, prompts, params)
    assert engine.compiled.steps_compiled > 10
    assert sorted(engine.compiled.graphs) == [1, 2, 4]  # no bucket needed a compile while serving
    assert compiled == eager
    assert engine.blocks.num_used == 0


def test_a_step_goes_to_the_smallest_bucket_that_holds_it(llama_dir: Path, kit: Any) -> None:
    from serving.engine.compile import CompiledForward

    runner = kit.PagedRunner(llama_dir)
    compiled = CompiledForward(runner.model, [4, 1, 2])
    assert [compiled.bucket_for(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]  # 5 tokens: eager
    assert not compiled.cuda_graphs  # CUDA graphs only on a CUDA device
