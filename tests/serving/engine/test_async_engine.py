from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from serving.engine.async_engine import AsyncEngine
from serving.engine.config import SpeculativeConfig
from serving.engine.types import EngineDeadError, GenerationRequest, RequestRejected, SamplingParams


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram-spec"])
def test_concurrent_streams_match_the_sync_engine(kit: Any, llama_dir: Path, speculative: bool) -> None:
    prompts = [p + p for p in kit.random_prompts([7, 19, 33, 4])]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = kit.run_to_completion(kit.make_engine(llama_dir), prompts, [params] * 4)
    spec = SpeculativeConfig(enabled=speculative, method="ngram", adaptive=False)

    async def main() -> list[list[int]]:
        engine = AsyncEngine(kit.make_engine(llama_dir, speculative=spec))
        await engine.start()

        async def one(i: int) -> list[int]:
            tokens: list[int] = []
            async for out in engine.generate(GenerationRequest(f"r{i}", prompts[i], params)):
                tokens += out.new_token_ids
                assert out.num_generated_tokens == len(tokens)
            assert out.finished and out.finish_reason == "length"
            return tokens

        results = await asyncio.gather(*(one(i) for i in range(4)))
        stats = engine.stats()
        assert stats.kv_blocks_used == 0 and stats.generation_tokens_total == 80
        assert (stats.spec.num_draft_tokens > 0) == speculative
        assert engine.healthy
        await engine.stop()
        assert not engine.healthy
        return list(results)

    assert asyncio.run(main()) == expected


def test_a_step_wakes_the_event_loop_once_for_all_its_outputs(kit: Any, llama_dir: Path) -> None:
    """One call_soon_threadsafe per step, not one per request: each is a wake-up of the loop (a self-pipe write,
    a return from its poll) taken under the GIL that the step loop needs too."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        wakeups = 0
        schedule = loop.call_soon_threadsafe

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal wakeups
            wakeups += 1
            return schedule(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        engine = AsyncEngine(kit.make_engine(llama_dir))
        await engine.start()

        async def one(i: int) -> int:
            return sum([len(out.new_token_ids) async for out in engine.generate(
                GenerationRequest(f"r{i}", [1 + i, 2, 3, 4], params))])

        tokens = await asyncio.gather(*(one(i) for i in range(4)))
        assert tokens == [12] * 4
        counts = wakeups, engine.stats().steps_total  # before stop(), whose threads wake the loop too
        await engine.stop()
        return counts

    wakeups, steps = asyncio.run(main())
    assert wakeups <= steps < 4 * 12  # four requests decoding together: a call per output would be ~4 a step


def test_abort_mid_generation_frees_blocks_and_ends_the_stream(kit: Any, llama_dir: Path) -> None:
    async def main() -> None:
        engine = AsyncEngine(kit.make_engine(llama_dir))
        await engine.start()
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        stream = engine.generate(GenerationRequest("a", list(range(1, 60)), params))
        first = await anext(stream)
        assert not first.finished
        assert engine.stats().kv_blocks_used > 0
        await engine.abort("a")
        assert engine.stats().kv_blocks_used == 0
        last = first
        async for out in stream:
            last = out
        assert last.finished and last.finish_reason == "abort"
        await engine.stop()

    asyncio.run(main())


def test_closing_the_stream_early_aborts_the_request(kit: Any, llama_dir: Path) -> None:
    async def main() -> None:
        engine = AsyncEngine(kit.make_engine(llama_dir))
        await engine.start()
        stream = engine.generate(GenerationRequest("a", [1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True)))
        await anext(stream)
        await stream.aclose()  # what a client disconnect looks like to the server
        for _ in range(100):
            if engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().num_running == 0 and engine.stats().kv_blocks_used == 0
        await engine.stop()

    asyncio.run(main())


def test_an_exception_in_the_step_loop_turns_health_bad(kit: Any, llama_dir: Path) -> None:
    async def main() -> None:
        engine = AsyncEngine(kit.make_engine(llama_dir))

        def broken_step() -> list:
            raise RuntimeError("device fell over")

        engine.engine.step = broken_step  # type: ignore[method-assign]
        await engine.start()
        assert engine.healthy
        with pytest.raises(EngineDeadError) as err:
            async for _ in engine.generate(GenerationRequest("a", [1, 2, 3], SamplingParams())):
                pass
        assert isinstance(err.value.__cause__, RuntimeError)
        assert not engine.healthy
        assert isinstance(engine.error, RuntimeError) and "device fell over" in str(engine.error)
        with pytest.raises(RequestRejected) as rejected:
            engine.check_admission(GenerationRequest("b", [1], SamplingParams()))
        assert rejected.value.kind == "unavailable"
        await engine.stop()

    asyncio.run(main())


def test_admission_errors_surface_before_streaming(kit: Any, llama_dir: Path) -> None:
    async def main() -> None:
        engine = AsyncEngine(kit.make_engine(llama_dir, max_model_len=64))
        await engine.start()
        with pytest.raises(RequestRejected) as err:
            async for _ in engine.generate(GenerationRequest("a", [1] * 60, SamplingParams(max_tokens=10))):
                pass
        assert err.value.kind == "never_fits"
        assert engine.max_model_len == 64 and engine.tokenizer is None
        await engine.stop()

    asyncio.run(main())
