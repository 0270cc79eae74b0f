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
from serving.engine.types import GenerationRequest, RequestRejected, SamplingParams


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
