"""Logprobs in the two OpenAI shapes: the legacy completions lists and chat's per-token objects."""

from __future__ import annotations

from typing import Any

from serving.engine.types import TokenLogprobs


def token_text(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id])) if tokenizer is not None else str(token_id)


def completion_logprobs(tokenizer: Any, entries: list[TokenLogprobs], offset: int) -> dict[str, Any]:
    """The legacy completions shape: parallel lists plus text offsets."""
    tokens = [token_text(tokenizer, e.token_id) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(tokenizer, t): lp for t, lp in e.top_logprobs} for e in entries],
        "text_offset": offsets,
    }


def prompt_logprobs_first(tokenizer: Any, prompt_ids: list[int], entries: list[TokenLogprobs | None],
                          generated: dict[str, Any]) -> dict[str, Any]:
    """echo: the prompt's tokens (the first has no logprob: null, as OpenAI reports it) before the generated ones."""
    tokens = [token_text(tokenizer, t) for t in prompt_ids]
    offsets, offset = [], 0
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens + generated["tokens"],
        "token_logprobs": [e.logprob if e is not None else None for e in entries] + generated["token_logprobs"],
        "top_logprobs": [{token_text(tokenizer, t): lp for t, lp in e.top_logprobs} if e is not None else None
                         for e in entries] + generated["top_logprobs"],
        "text_offset": offsets + generated["text_offset"],
    }


def chat_logprobs(tokenizer: Any, entries: list[TokenLogprobs]) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [
        {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top_logprobs]}
        for e in entries
    ]}
