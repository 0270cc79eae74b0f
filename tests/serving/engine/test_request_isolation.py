"""Issue 18 item 1: a request that fails inside the engine loop fails alone; the loop and the other
streams go on. Seeds outside the signed 64-bit range and denormal temperatures are refused or greedy."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from serving.engine.async_engine import AsyncEngine
from serving.engine.sampling import sample_requests
from serving.engine.types import (
    EngineDeadError,
    GenerationRequest,
    RequestRejected,
    SamplingParams,
    StepFailedError,
)


@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1])
def test_seed_outside_int64_is_invalid(seed: int) -> None:
    with pytest.raises(ValueError, match="seed must be between"):
        SamplingParams(seed=seed).validate()


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 0])
def test_seed_inside_int64_seeds_a_generator(seed: int) -> None:
    SamplingParams(seed=seed).validate()
    torch.Generator().manual_seed(seed)


def test_a_request_that_fails_while_queueing_fails_alone(kit: Any, llama_dir: Path) -> None:
    engine = kit.make_engine(llama_dir)
    real_enqueue = engine.enqueue

    def enqueue(request: GenerationRequest) -> None:
        if request.request_id == "poison":  # e.g. a seed torch cannot take, past every check
            raise ValueError("Overflow when unpacking long long")
        real_enqueue(request)

    engine.enqueue = enqueue
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main() -> None:
        async_engine = AsyncEngine(engine)
        await async_engine.start()

        async def one(request_id: str) -> list[int]:
            tokens: list[int] = []
            async for out in async_engine.generate(GenerationRequest(request_id, [1, 2, 3, 4], params)):
                tokens += out.new_token_ids
            return tokens

        others = [asyncio.create_task(one(f"ok{i}")) for i in range(3)]
        await asyncio.sleep(0.05)
        with pytest.raises(RequestRejected, match="Overflow"):
            await one("poison")
        results = await asyncio.gather(*others)
        assert all(len(r) == 12 for r in results)
        assert async_engine.healthy and async_engine.error is None
        assert len(await one("after")) == 12
        assert async_engine.stats().kv_blocks_used == 0
        await async_engine.stop()

    asyncio.run(main())


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-30, 1e-6])
def test_denormal_temperature_is_greedy(temperature: float) -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=temperature)] * 3
    generators = [torch.Generator().manual_seed(i) for i in range(3)]
    assert torch.equal(sample_requests(logits, params, generators), logits.argmax(dim=-1))


# ---- a step that raises fails the requests it ran; the loop goes on ------------------------------------


def _faulty_model(engine: Any, fail_calls: set[int], message: str = "out of memory on a rare shape") -> list[int]:
    """Make the engine's forward raise on the listed calls (0-based); returns the live call counter."""
    real_forward = engine.model.forward
    calls = [0]

    def forward(*args: Any, **kwargs: Any) -> Any:
        n = calls[0]
        calls[0] += 1
        if n in fail_calls:
            raise RuntimeError(message)
        return real_forward(*args, **kwargs)

    engine.model.forward = forward
    return calls


async def _collect(async_engine: AsyncEngine, request_id: str, max_tokens: int = 12) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens: list[int] = []
    async for out in async_engine.generate(GenerationRequest(request_id, [1, 2, 3, 4], params)):
        tokens += out.new_token_ids
    return tokens


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(kit: Any, llama_dir: Path) -> None:
    reference = kit.make_engine(llama_dir)
    expected = kit.run_to_completion(reference, [[1, 2, 3, 4]],
                                     [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)])[0]
    engine = kit.make_engine(llama_dir)
    _faulty_model(engine, {3})  # the fourth forward (mid-decode of the first batch) raises

    async def main() -> None:
        async_engine = AsyncEngine(engine)
        await async_engine.start()
        first = [asyncio.create_task(_collect(async_engine, f"a{i}")) for i in range(3)]
        results = await asyncio.gather(*first, return_exceptions=True)
        assert all(isinstance(r, StepFailedError) for r in results), results
        assert async_engine.healthy and async_engine.error is None
        stats = async_engine.stats()
        assert stats.step_failures_total == 1 and stats.kv_blocks_used == 0 and stats.num_running == 0
        # the engine keeps serving, with the same greedy output as an engine that never failed
        after = await asyncio.gather(*[_collect(async_engine, f"b{i}") for i in range(2)])
        assert after == [expected, expected]
        await async_engine.stop()

    asyncio.run(main())


def test_queued_requests_survive_a_failed_step(kit: Any, llama_dir: Path) -> None:
    engine = kit.make_engine(llama_dir, max_concurrency=1)  # the second request waits while the first runs
    _faulty_model(engine, {2})

    async def main() -> None:
        async_engine = AsyncEngine(engine)
        await async_engine.start()
        running = asyncio.create_task(_collect(async_engine, "running"))
        await asyncio.sleep(0)
        queued = asyncio.create_task(_collect(async_engine, "queued"))
        with pytest.raises(StepFailedError, match="rare shape"):
            await running
        assert len(await queued) == 12
        assert async_engine.healthy
        await async_engine.stop()

    asyncio.run(main())


@pytest.mark.parametrize("message, fails_before_dead", [
    ("out of memory on a rare shape", 3),  # repeated failures: the engine is broken, not the batch
    ("CUDA error: an illegal memory access was encountered", 1),  # the device context is lost at once
])
def test_repeated_or_fatal_step_failures_make_the_engine_dead(kit: Any, llama_dir: Path, message: str,
                                                                fails_before_dead: int) -> None:
    engine = kit.make_engine(llama_dir)
    _faulty_model(engine, set(range(1000)), message)

    async def main() -> None:
        async_engine = AsyncEngine(engine)
        await async_engine.start()
        for _ in range(fails_before_dead - 1):
            with pytest.raises(StepFailedError):
                await _collect(async_engine, "x")
            assert async_engine.healthy
        with pytest.raises(EngineDeadError):
            await _collect(async_engine, "last")
        assert not async_engine.healthy and message in str(async_engine.error)
        with pytest.raises(RequestRejected, match="not running"):
            await _collect(async_engine, "refused")
        await async_engine.stop()

    asyncio.run(main())
