"""n > 1: one engine request per choice, run side by side and merged into one response.

The choices share the prompt's KV blocks through the engine's prefix cache (content-addressed full blocks).
A block gets its address only once its forward has run, so siblings admitted in the same step as the first
choice would all compute the prompt. The first choice therefore starts alone; the others are queued once
it has produced its first output (its prompt is then in the cache), and compute only the prompt's last,
partial block. Each choice has its own generator: seed + index when the request is seeded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from serving.api.generation import Collected, GenerationRun, aborted_error, start_run
from serving.api.schemas import SamplingFields
from serving.api.state import Engine, ServerState
from serving.engine.types import SEED_RANGE, RequestOutput

_DONE = object()  # a choice's stream ended


class Choices:
    """The runs of one request's choices; ``outputs()`` yields (choice index, output) as they come.

    Runs come in groups of ``group_size`` sharing one prompt (completions may send several prompts): each
    group's first run leads, its siblings start after the leader's first output."""

    def __init__(self, runs: list[GenerationRun], group_size: int | None = None) -> None:
        self.runs = runs
        self.group_size = group_size or len(runs)
        self.request_id = runs[0].request.request_id
        self._tasks: list[asyncio.Future[None]] = []  # one per started choice (n > 1)

    @classmethod
    def concat(cls, groups: list[Choices]) -> Choices:
        """The choices of several prompts, alike in number, as one response's choices (prompt by prompt)."""
        runs = [run for group in groups for run in group.runs]
        runs[0].log_fields["engine_request_id"] = runs[0].request.request_id  # the one the response carries
        return cls(runs, groups[0].group_size)

    async def prime(self) -> None:
        """Wait for the first choice's first output (a stream's status code can still be an error)."""
        await self.runs[0].prime()

    async def close(self) -> None:
        """The response is over or its client left: stop every choice (their engine requests are aborted)."""
        await _cancel(self._tasks)
        for run in self.runs:
            await run.close()

    async def collect(self) -> list[Collected]:
        """Every choice's whole output, in choice order."""
        results = [Collected() for _ in self.runs]
        parts: list[list[str]] = [[] for _ in self.runs]
        async for index, output in self.outputs():
            parts[index].append(output.new_text)
            results[index].logprobs.extend(output.logprobs or [])
            if output.prompt_logprobs is not None:
                results[index].prompt_logprobs = output.prompt_logprobs
            if output.finished:
                results[index].finish_reason = output.finish_reason
        for result, texts in zip(results, parts, strict=True):
            result.text = "".join(texts)
            if result.finish_reason in (None, "abort"):
                raise aborted_error()
        return results

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(self.runs) == 1:
            async with contextlib.aclosing(self.runs[0].outputs()) as stream:
                async for output in stream:
                    yield 0, output
            return
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async with contextlib.aclosing(self.runs[index].outputs()) as stream:
                    async for output in stream:
                        await queue.put((index, output))
                        if index % size == 0 and index not in led:  # its prompt is in the prefix cache now
                            led.add(index)
                            self._tasks.extend(asyncio.ensure_future(pump(i)) for i in range(index + 1, index + size))
            except BaseException as exc:  # re-raised by the consumer, which cancels the other choices
                await queue.put((index, exc))
                return
            await queue.put((index, _DONE))

        size, led = self.group_size, set[int]()  # led: groups whose siblings were started
        self._tasks = [asyncio.ensure_future(pump(i)) for i in range(0, len(self.runs), size)]
        remaining = len(self.runs)
        try:
            while remaining:
                index, item = await queue.get()
                if item is _DONE:
                    remaining -= 1
                    if index % size == 0 and index not in led:  # ended without any output: no siblings start
                        remaining -= size - 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            await _cancel(self._tasks)

    @property
    def usage(self) -> dict[str, int]:
        """Each prompt counted once, as OpenAI does; completion tokens of all choices."""
        prompt = sum(run.prompt_tokens for run in self.runs[:: self.group_size])
        completion = sum(run.completion_tokens for run in self.runs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _cancel(tasks: list[asyncio.Future[None]]) -> None:
    for task in tasks:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


def start_choices(request: Request, state: ServerState, engine: Engine, body: SamplingFields, prompt_ids: list[int],
                  max_tokens: int | None, logprobs: int | None, id_prefix: str, count: int,
                  prompt_logprobs: int | None = None) -> Choices:
    """Admit ``count`` choices of one prompt: alike but for their request ids and seeds."""
    runs = [start_run(request, state, engine, body, prompt_ids, max_tokens, logprobs, id_prefix, prompt_logprobs)
            for _ in range(count)]
    runs[0].log_fields["engine_request_id"] = runs[0].request.request_id  # the one the response carries
    for index, run in enumerate(runs[1:], start=1):
        params = run.request.params
        if params.seed is not None:  # wrap within the signed 64-bit range the generator takes
            span = SEED_RANGE[1] - SEED_RANGE[0] + 1
            params.seed = (params.seed + index - SEED_RANGE[0]) % span + SEED_RANGE[0]
    return Choices(runs)
