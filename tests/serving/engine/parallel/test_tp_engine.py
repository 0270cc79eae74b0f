"""Tensor parallelism across real processes (gloo on CPU): the same logits as one process, no orphans."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from serving.engine.engine import LLMEngine
from serving.engine.types import EngineDeadError, GenerationRequest, SamplingParams

pytestmark = pytest.mark.slow


def running(pids: list[int]) -> list[int]:
    """The pids of the list that ps still shows (a zombie counts as gone: it has exited)."""
    out = subprocess.run(["ps", "-o", "pid=,stat=", "-p", ",".join(map(str, pids))], capture_output=True,
                         text=True, check=False).stdout
    return [int(line.split()[0]) for line in out.splitlines() if line.split() and "Z" not in line.split()[1]]


def record_logits(engine: LLMEngine) -> list[torch.Tensor]:
    """Every logits tensor the engine computes, in order."""
    seen: list[torch.Tensor] = []
    compute = engine.model.compute_logits

    def recording(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        seen.append(compute(hidden, rows))
        return seen[-1]

    engine.model.compute_logits = recording  # type: ignore[method-assign]
    return seen


@pytest.fixture(scope="module")
def models(kit, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    gqa = {"num_attention_heads": 8, "num_key_value_heads": 4}
    return {
        "llama": kit.save_tiny_model(tmp_path_factory.mktemp("tp-llama"), "llama"),  # 4 heads, 2 KV heads
        "qwen2": kit.save_tiny_model(tmp_path_factory.mktemp("tp-qwen2"), "qwen2"),
        "llama-gqa": kit.save_tiny_model(tmp_path_factory.mktemp("tp-llama-gqa"), "llama", **gqa),
        "qwen2-gqa": kit.save_tiny_model(tmp_path_factory.mktemp("tp-qwen2-gqa"), "qwen2", **gqa),
    }


@pytest.mark.parametrize(("model", "tp"), [("llama", 2), ("qwen2", 2), ("llama-gqa", 4), ("qwen2-gqa", 4)])
def test_logits_match_one_process(kit, models: dict[str, Path], model: str, tp: int) -> None:
    # prompts long enough for chunked prefill (128-token steps), then mixed decode steps
    prompts = kit.random_prompts([5, 17, 40, 150])
    params = [SamplingParams(temperature=0.0, max_tokens=6)] * len(prompts)
    single = kit.make_engine(models[model])
    expected_logits = record_logits(single)
    expected = kit.run_to_completion(single, prompts, params)

    engine = kit.make_engine(models[model], tensor_parallel_size=tp)
    pids = engine.runner.tp_group.worker_pids
    try:
        assert len(pids) == tp - 1 and running(pids) == pids
        # the KV cache is sharded by KV head
        assert engine.runner.cache.n_kv_heads == single.runner.cache.n_kv_heads // tp
        got_logits = record_logits(engine)
        got = kit.run_to_completion(engine, prompts, params)
    finally:
        engine.close()
    assert got == expected
    assert len(got_logits) == len(expected_logits)
    for g, e in zip(got_logits, expected_logits, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-5)
    assert running(pids) == [], "workers outlived engine.close()"


def test_a_rank_lost_while_idle_makes_the_engine_unhealthy_without_a_request(kit, models: dict[str, Path]) -> None:
    from serving.engine.async_engine import AsyncEngine

    async def scenario() -> tuple[BaseException | None, list[int]]:
        engine = AsyncEngine(kit.make_engine(models["llama"], tensor_parallel_size=2))
        pids = engine.engine.runner.tp_group.worker_pids
        await engine.start()
        try:
            assert engine.healthy
            os.kill(pids[0], signal.SIGKILL)
            deadline = time.monotonic() + 10
            while engine.healthy and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not engine.healthy
            return engine.error, pids
        finally:
            await engine.stop()

    error, pids = asyncio.run(scenario())
    assert isinstance(error, EngineDeadError) and "tensor-parallel rank 1" in str(error), error
    assert running(pids) == []


def test_a_hung_rank_times_out_the_collective_and_kills_the_engine(kit, models: dict[str, Path]) -> None:
    engine = kit.make_engine(models["llama"], tensor_parallel_size=2, collective_timeout_s=3)
    pids = engine.runner.tp_group.worker_pids
    try:
        os.kill(pids[0], signal.SIGSTOP)  # alive but never answers: only the collective's timeout can tell
        engine.add_request(kit_request(kit))
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="all-reduce failed"):
            engine.step()
        assert time.monotonic() - started < 30
        with pytest.raises(EngineDeadError):  # a broken group never runs another step
            engine.step()
    finally:
        engine.close()
    assert running(pids) == []


def kit_request(kit) -> GenerationRequest:
    return GenerationRequest("hung", kit.random_prompts([9])[0], SamplingParams(temperature=0.0, max_tokens=4))
