"""Incremental detokenization and stop strings.

Text is decoded from a short window of recent tokens (not the whole output each step), and a delta is
released only once it is complete (no dangling U+FFFD of a half-decoded character). Text that might be
the start of a stop string is held back until it is known not to be one, so a stop string never leaks
into streamed output.
"""

from __future__ import annotations

from typing import Protocol

# Decode windows start this many tokens before the first new token, so tokenizers that drop a leading
# space at the start of a decode (sentencepiece) see enough left context.
_PREFIX_WINDOW = 6


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.token_ids = list(prompt_token_ids[-_PREFIX_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""  # all output text so far (cut at a stop string once one is found)
        self.emitted = 0  # characters of text already handed out

    def append(self, new_token_ids: list[int]) -> str | None:
        """Add generated tokens; returns the stop string if one now appears in the text."""
        if self.tokenizer is None:
            return None
        self.token_ids.extend(new_token_ids)
        prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset],
                                       skip_special_tokens=True)
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # nothing complete yet
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        start = max(len(self.text) - self.hold_back, 0)
        self.text += delta
        return self._find_stop(start)

    def _find_stop(self, search_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def take_new_text(self, finished: bool) -> str:
        """Text not handed out yet; while unfinished, keeps back what could still begin a stop string."""
        end = len(self.text) if finished or not self.stop else max(len(self.text) - self.hold_back, self.emitted)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
