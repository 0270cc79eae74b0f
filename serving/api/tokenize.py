"""Tokenization off the event loop: a small worker pool with a bounded queue, behind a character-length
pre-check. A prompt near the body limit takes long to tokenize; on the event loop it stalled every other
request and /health with it (a liveness probe could restart a healthy server).

The pre-check is exact, not a guess: no token is longer than the tokenizer's longest vocabulary entry (in
characters of the vocabulary's own alphabet, which for byte-level BPE is one per byte), so a text of more
than ``max_input_len * longest`` characters has more than ``max_input_len`` tokens and is refused untokenized.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from serving.api.errors import ApiError

T = TypeVar("T")

_FALLBACK_LONGEST_TOKEN = 256  # a tokenizer without get_vocab(): no real vocabulary entry is longer


def longest_token_chars(tokenizer: Any) -> int:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return _FALLBACK_LONGEST_TOKEN
    return max((len(token) for token in get_vocab()), default=_FALLBACK_LONGEST_TOKEN) or 1


class TokenizerPool:
    """Runs tokenizer calls in ``workers`` threads; at most ``max_pending`` wait or run at once (429 beyond)."""

    def __init__(self, tokenizer: Any, max_input_len: int, workers: int = 2, max_pending: int = 32) -> None:
        if workers < 1 or max_pending < workers:
            raise ValueError(f"need workers >= 1 and max_pending >= workers, got {workers} and {max_pending}")
        self.tokenizer = tokenizer
        self.max_chars = max_input_len * longest_token_chars(tokenizer)
        self.max_pending = max_pending
        self.pending = 0
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize")

    def check_length(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise ApiError(400, f"{param} has {chars} characters; more than the maximum input length allows "
                           f"(at most {self.max_chars} characters)", param=param, code="context_length_exceeded")

    async def run(self, work: Callable[[], T]) -> T:
        with self._lock:
            if self.pending >= self.max_pending:
                raise ApiError(429, f"server busy: {self.pending} prompts waiting to be tokenized",
                               code="queue_full", retry_after=1)
            self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, work)
        finally:
            with self._lock:
                self.pending -= 1

    async def encode(self, text: str, *, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer; send the prompt as token ids", param=param,
                           code="no_tokenizer")
        self.check_length(len(text), param)

        def work() -> list[int]:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

        try:
            return await self.run(work)
        except (TypeError, ValueError, UnicodeError) as exc:  # the text's fault (the schema refuses surrogates)
            raise ApiError(400, f"{param}: cannot tokenize: {exc}", param=param, code="invalid_value") from exc

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
