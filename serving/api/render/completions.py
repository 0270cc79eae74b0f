"""POST /v1/completions' answer: a text_completion (best_of candidates ranked, the prompt echoed), or its stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from serving.api.render.logprobs import completion_logprobs, prompt_logprobs_first
from serving.api.run import Choices, Collected, check_finish
from serving.api.schemas import CompletionRequest
from serving.api.state import ServerState


def whole(choices: Choices, base: dict[str, Any], body: CompletionRequest, tokenizer: Any,
          prompt_ids: list[list[int]], echoes: list[str], results: list[Collected]) -> dict[str, Any]:
    """Choices prompt by prompt: OpenAI's index of choice j of prompt i is i * n + j."""
    out = []
    for i, ids in enumerate(prompt_ids):
        group = results[i * body.candidates : (i + 1) * body.candidates]
        if body.candidates > body.choices:  # best_of: the n best candidates
            group = sorted(group, key=mean_logprob, reverse=True)[: body.choices]
        out += [choice(tokenizer, body, i * body.choices + j, r, ids, echoes[i]) for j, r in enumerate(group)]
    return {**base, "choices": out, "usage": choices.usage}


async def echo_text(state: ServerState, tokenizer: Any, prompt: str | list[int], prompt_ids: list[int]) -> str:
    """The prompt as the response repeats it: its own text, or the decoded ids of a token prompt."""
    if isinstance(prompt, str):
        return prompt
    if tokenizer is None:
        return ""
    return str(await state.tokenizers.run(lambda: tokenizer.decode(prompt_ids)))


def mean_logprob(result: Collected) -> float:
    """best_of ranks candidates by log-probability per token, as OpenAI does."""
    return sum(e.logprob for e in result.logprobs) / max(len(result.logprobs), 1)


def choice(tokenizer: Any, body: CompletionRequest, index: int, result: Collected, prompt_ids: list[int],
           echo: str) -> dict[str, Any]:
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(tokenizer, result.logprobs, len(echo))
        if body.echo:
            logprobs = prompt_logprobs_first(tokenizer, prompt_ids, result.prompt_logprobs or [], logprobs)
    return {"index": index, "text": echo + result.text, "logprobs": logprobs, "finish_reason": result.finish_reason}


async def chunks(choices: Choices, base: dict[str, Any], body: CompletionRequest, tokenizer: Any,
                 prompt_ids: list[list[int]], echoes: list[str]) -> AsyncIterator[dict[str, Any]]:
    """Streamed: best_of is n (the schema says so), so run i is choice i, of prompt i // n."""
    n = body.choices
    offsets = [len(echoes[i // n]) for i in range(len(choices.runs))]
    echoed = [False] * len(choices.runs)
    usage_field = {"usage": None} if body.include_usage else {}
    async for index, output in choices.outputs():
        check_finish(output)
        if not output.new_text and not output.finished and not output.logprobs and echoed[index]:
            continue
        echo = "" if echoed[index] else echoes[index // n]
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(tokenizer, output.logprobs or [], offsets[index])
            if body.echo and not echoed[index]:
                logprobs = prompt_logprobs_first(tokenizer, prompt_ids[index // n], output.prompt_logprobs or [],
                                                 logprobs)
        echoed[index] = True
        offsets[index] += len(output.new_text)
        item = {"index": index, "text": echo + output.new_text, "logprobs": logprobs,
                "finish_reason": output.finish_reason if output.finished else None}
        yield {**base, "choices": [item], **usage_field}
    if body.include_usage:
        yield {**base, "choices": [], "usage": choices.usage}
