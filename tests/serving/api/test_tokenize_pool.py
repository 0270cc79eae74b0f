"""Issue 18 item 3: tokenization runs in a bounded worker pool behind a character pre-check, so a big
prompt never stalls the event loop (and with it /health)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from serving.api.errors import ApiError
from serving.api.tokenize import TokenizerPool


class SlowTokenizer:
    """Holds the calling thread like a long prompt does; vocabulary entries of at most 4 characters."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.calls = 0
        self.release = threading.Event()

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "abcd": 1, "xy": 2}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        self.release.wait(self.seconds)
        return [1] * (len(text) // 4)


def test_the_event_loop_keeps_ticking_while_prompts_are_tokenized() -> None:
    tokenizer = SlowTokenizer(0.5)
    pool = TokenizerPool(tokenizer, max_input_len=1000, workers=2)

    async def main() -> float:
        ticks: list[float] = []

        async def ticker() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        task = asyncio.create_task(ticker())
        await asyncio.gather(*(pool.encode("abcd" * 900, add_special_tokens=True) for _ in range(2)))
        task.cancel()
        return max(b - a for a, b in zip(ticks, ticks[1:], strict=False))

    worst_gap = asyncio.run(main())
    assert tokenizer.calls == 2
    assert worst_gap < 0.25, f"event loop stalled for {worst_gap:.2f}s"


def test_text_longer_than_any_tokenization_allows_is_refused_untokenized() -> None:
    tokenizer = SlowTokenizer(0)
    pool = TokenizerPool(tokenizer, max_input_len=10, workers=1)
    assert pool.max_chars == 40  # 10 tokens of at most 4 characters
    with pytest.raises(ApiError) as refused:
        asyncio.run(pool.encode("a" * 41, add_special_tokens=True))
    assert refused.value.status == 400 and "41 characters" in refused.value.message
    assert tokenizer.calls == 0
    assert len(asyncio.run(pool.encode("abcd" * 10, add_special_tokens=True))) == 10


def test_the_queue_is_bounded() -> None:
    tokenizer = SlowTokenizer(5)
    pool = TokenizerPool(tokenizer, max_input_len=100, workers=1, max_pending=2)

    async def main() -> ApiError:
        first = [asyncio.create_task(pool.encode("ab", add_special_tokens=True)) for _ in range(2)]
        await asyncio.sleep(0.05)
        try:
            await pool.encode("ab", add_special_tokens=True)
        except ApiError as exc:
            tokenizer.release.set()
            await asyncio.gather(*first)
            return exc
        raise AssertionError("a third prompt was queued past max_pending=2")

    refused = asyncio.run(main())
    assert refused.status == 429 and refused.retry_after
    assert pool.pending == 0


def test_tokenizer_errors_are_the_request_s_fault() -> None:
    class Broken(SlowTokenizer):
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")

    with pytest.raises(ApiError) as refused:
        asyncio.run(TokenizerPool(Broken(0), 10).encode("x", add_special_tokens=True))
    assert refused.value.status == 400


def test_bad_pool_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="max_pending"):
        TokenizerPool(SlowTokenizer(0), 10, workers=4, max_pending=2)

