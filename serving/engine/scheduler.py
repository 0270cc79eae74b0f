"""Continuous batching with chunked prefill, FCFS, and preemption by recompute.

Every request is "num_computed_tokens of num_tokens are in the cache"; a step gives each scheduled
request the next slice of its tokens (a prefill chunk, its one new token, or its last token plus draft
tokens to verify), under one token budget. Running requests go first, in arrival order; when the pool
runs out of blocks, the latest-arrived running request is preempted (its blocks freed, its tokens
recomputed later), so memory never overflows. Waiting requests are admitted FCFS while budget, sequence
slots and blocks last; an admitted request starts on the cached blocks of its longest cached prefix (prefix
caching, see kv_cache.py) and computes only the rest. A preempted request is matched again when it returns,
so its recomputation is mostly cache hits unless its blocks were evicted meanwhile.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from serving.engine.kv_cache import BlockManager
from serving.engine.request import Request, RequestStatus
from serving.engine.types import TokenLogprobs


@dataclass
class SchedulerOutput:
    scheduled: list[Request]  # requests in this step's forward, running ones first
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens in the forward (chunk, 1, or 1 + drafts)
    spec_token_ids: dict[str, list[int]]  # req_id -> draft tokens verified this step (absent: none)
    total_num_scheduled_tokens: int  # sum of num_scheduled_tokens: the forward's batch size in tokens
    num_prefill_tokens: int  # of which prompt (or recomputed) tokens
    preempted_ids: list[str] = field(default_factory=list)  # preempted this step, blocks already freed

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def samples(self, req: Request) -> bool:
        """Whether req reaches the end of its tokens this step and so produces a new token."""
        return req.num_computed_tokens + self.num_scheduled_tokens[req.request_id] >= req.num_tokens


@dataclass
class SchedulerCounters:
    prompt_tokens_total: int = 0  # prefilled tokens, recomputation included
    generation_tokens_total: int = 0
    preemptions_total: int = 0
    requests_finished_total: int = 0
    prefix_cache_queries_total: int = 0  # tokens of admitted requests looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of which found there (not computed)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_concurrency: int, max_batched_tokens: int) -> None:
        self.blocks = blocks
        self.max_concurrency = max_concurrency
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.counters = SchedulerCounters()

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request_id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_batched_tokens
        scheduled: list[Request] = []
        num_tokens: dict[str, int] = {}
        spec: dict[str, list[int]] = {}
        preempted: list[str] = []
        prefill = 0

        # running requests first: each continues its prefill, decodes, or verifies its drafts
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens + len(req.spec_token_ids) - req.num_computed_tokens, budget)
            while not self.blocks.allocate(req.request_id, req.num_computed_tokens + n):
                victim = self.running.pop()  # the latest arrival gives way
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # req preempted itself: everything after it is gone too
            drafts = max(n - (req.num_tokens - req.num_computed_tokens), 0)
            if drafts:
                spec[req.request_id] = req.spec_token_ids[:drafts]
            prefill += max(min(req.num_prompt_tokens, req.num_computed_tokens + n) - req.num_computed_tokens, 0)
            scheduled.append(req)
            num_tokens[req.request_id] = n
            budget -= n
            i += 1

        # then waiting requests, first come first served, while nobody had to be preempted
        while self.waiting and budget > 0 and len(self.running) < self.max_concurrency and not preempted:
            req = self.waiting[0]
            # prompt logprobs need the logits of every prompt position: no prefix from the cache
            cached = 0 if req.wants_prompt_logprobs else self.blocks.match_prefix(req.request_id, req.all_token_ids)
            req.num_computed_tokens = cached
            n = min(req.num_tokens - cached, budget)
            if not self.blocks.allocate(req.request_id, cached + n):
                self.blocks.free(req.request_id)  # give back the cached blocks it took
                req.num_computed_tokens = 0
                break
            self.counters.prefix_cache_queries_total += req.num_tokens
            self.counters.prefix_cache_hits_total += cached
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(req)
            num_tokens[req.request_id] = n
            prefill += n
            budget -= n

        for req in scheduled:
            if req.request_id not in spec:
                req.spec_token_ids = []
        self.counters.prompt_tokens_total += prefill
        return SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=num_tokens,
            spec_token_ids=spec,
            total_num_scheduled_tokens=self.max_batched_tokens - budget,
            num_prefill_tokens=prefill,
            preempted_ids=preempted,
        )

    def _preempt(self, req: Request) -> None:
        self.blocks.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.counters.preemptions_total += 1
        self.waiting.appendleft(req)

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: dict[str, list[int]],
        logprobs: dict[str, list[TokenLogprobs]] | None = None,
    ) -> list[Request]:
        """Advance the scheduled requests by the step's result.

        sampled: req_id -> tokens to append (empty for a partial prefill chunk; for a verified request the
        accepted drafts plus one sampled token). Rejected drafts are rolled back by truncating the cache.
        Returns the requests that produced tokens or finished, for the engine to stream.
        """
        updated: list[Request] = []
        for req in out.scheduled:
            if req.is_finished:  # aborted while the step ran
                continue
            n = out.num_scheduled_tokens[req.request_id]
            drafts = out.spec_token_ids.get(req.request_id, [])
            new = sampled.get(req.request_id, [])
            # drafts are in the cache after the forward; only the accepted ones stay computed
            accepted_drafts = max(len(new) - 1, 0) if drafts else 0
            req.num_computed_tokens += n - len(drafts) + accepted_drafts
            req.spec_token_ids = []
            if not new:
                self.blocks.commit(req.request_id, req.all_token_ids, req.num_computed_tokens)
                continue
            req.append_output_tokens(new, (logprobs or {}).get(req.request_id))
            self.counters.generation_tokens_total += len(new)
            # the last appended token has no K/V yet; anything computed past it is rolled back
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            self.blocks.truncate(req.request_id, req.num_computed_tokens)
            # blocks now full of accepted tokens become reusable by content (a finished request's too)
            self.blocks.commit(req.request_id, req.all_token_ids, req.num_computed_tokens)
            updated.append(req)
            if req.is_finished:
                self._free_finished(req)
        return updated

    def finish_request(self, request_id: str, reason: str = "abort") -> Request | None:
        """Abort (or otherwise end) a request now: it leaves the queues and its blocks return to the pool."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        req.finish("abort" if reason == "abort" else "stop")
        self._free_finished(req)
        return req

    def _free_finished(self, req: Request) -> None:
        self.blocks.free(req.request_id)
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.requests.pop(req.request_id, None)
        self.counters.requests_finished_total += 1
