"""The engine core: `step()` = schedule → run → sample or verify → update, one batch at a time.

The core owns the requests (the scheduler and its KV block accounting), admission, abort, the stats and the
recovery from a failed step. The model runner (serving.engine.model_runner) runs each step; the build step
(serving.engine.build) loads, sizes and tunes it in `from_config`.

Not thread-safe: one thread drives it (the async wrapper's loop thread, a benchmark, a test).
"""

from __future__ import annotations

import collections
import logging
import random
import time
from typing import Any

from serving.engine.build import load, tune
from serving.engine.config import EngineConfig
from serving.engine.kv_cache import BlockManager
from serving.engine.model_runner import ModelRunner
from serving.engine.request import Request
from serving.engine.scheduler import Scheduler
from serving.engine.spec.speculator import Speculator
from serving.engine.types import (
    EngineStats,
    GenerationRequest,
    RequestOutput,
    RequestRejected,
    SpecStats,
)

log = logging.getLogger(__name__)


class LLMEngine:
    # ---- construction -------------------------------------------------------------------------------

    def __init__(self, runner: ModelRunner, config: EngineConfig, tokenizer: Any | None = None) -> None:
        self.runner = runner
        self.config = config
        self.tokenizer = tokenizer
        self.model = runner.model  # the target, which the runner runs: admission reads its vocabulary and context
        self.args = self.model.args
        self.max_model_len = self.model.max_model_len
        self.device, self.dtype = runner.device, runner.dtype
        self.block_size = config.kv_block_size
        self.blocks = BlockManager(runner.cache.num_blocks, self.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_concurrency, config.max_batched_tokens)
        self._seed_source = random.Random(config.seed)
        self.steps_total = 0
        self.step_time_total_s = 0.0
        self.step_failures_total = 0
        self._in_step: list[str] = []  # ids of the requests the current step scheduled
        self.last_step_s = 0.0
        self.recent_step_durations_s: collections.deque[float] = collections.deque(maxlen=512)
        # every choice the engine took by itself at start-up, as (setting, what was chosen, why): from_config
        # logs them on one line, and the benchmarks print them beside their figures (serving.engine.build.tune)
        self.startup_decisions: list[tuple[str, str, str]] = []

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        runner, tokenizer, why_dtype = load(config)
        engine = cls(runner, config, tokenizer)
        engine.startup_decisions = tune(runner, config, why_dtype)
        log.info("start-up decisions: %s",
                 "; ".join(f"{key} {value} ({why})" for key, value, why in engine.startup_decisions))
        return engine

    @property
    def speculator(self) -> Speculator | None:
        """The runner's speculator: it verifies drafts in the runner's step and proposes between steps here."""
        return self.runner.speculator

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (the engine runs no step after this)."""
        self.runner.close()

    def check_alive(self) -> None:
        """Raise (EngineDeadError) if a tensor-parallel rank has died; the step loop calls it while idle too."""
        self.runner.check_alive()

    # ---- requests -----------------------------------------------------------------------------------

    def check_admission(self, request: GenerationRequest, queued_elsewhere: int = 0) -> None:
        """Raise RequestRejected if the request is invalid, can never fit, or cannot be queued now.

        The one admission check: every limit of the engine is tested here, once per request.
        queued_elsewhere: requests admitted but not yet in the scheduler's queue (the async wrapper's)."""
        params, n_prompt = request.params, len(request.prompt_token_ids)
        # The one context-length check (the server's errors are this one's). A prompt that fills the context leaves
        # no room for a token to generate, unless the request only scores it.
        total = n_prompt + params.max_tokens
        scoring_only = params.max_tokens == 0 and params.prompt_logprobs is not None
        no_room = n_prompt >= self.max_model_len and params.max_tokens < 1 and not scoring_only
        if total > self.max_model_len or no_room:
            raise RequestRejected(
                "never_fits",
                f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the context length "
                f"{self.max_model_len}", param="max_tokens",
            )
        try:
            params.validate()
        except ValueError as exc:
            raise RequestRejected("invalid", str(exc)) from exc
        if n_prompt == 0:
            raise RequestRejected("invalid", "prompt is empty")
        if any(not 0 <= t < self.args.vocab_size for t in request.prompt_token_ids):
            raise RequestRejected("invalid", f"prompt has token ids outside [0, {self.args.vocab_size})")
        if any(not 0 <= t < self.args.vocab_size for t in request.params.logit_bias):
            raise RequestRejected("invalid", f"logit_bias has token ids outside [0, {self.args.vocab_size})")
        if request.params.stop and self.tokenizer is None:
            raise RequestRejected("invalid", "stop strings need a tokenizer; this model has none")
        lookahead = self.config.speculative.num_draft_tokens if self.config.speculative.enabled else 0
        needed = self.blocks.blocks_for(total + lookahead)
        if needed > self.blocks.num_blocks:
            raise RequestRejected(
                "never_fits",
                f"prompt + max_tokens = {total} tokens needs {needed} KV blocks of {self.block_size}; "
                f"the cache has {self.blocks.num_blocks} in all",
            )
        queued = len(self.scheduler.waiting) + queued_elsewhere
        if queued >= self.config.max_queue:
            raise RequestRejected("queue_full", f"{queued} requests already queued")

    def add_request(self, request: GenerationRequest) -> None:
        self.check_admission(request)
        self.enqueue(request)

    def enqueue(self, request: GenerationRequest) -> None:
        """Queue a request that check_admission accepted (add_request checks it first)."""
        self.scheduler.add_request(Request(
            request.request_id,
            request.prompt_token_ids,
            request.params,
            eos_token_ids=self.args.eos_token_ids,
            max_model_len=self.max_model_len,
            tokenizer=self.tokenizer,
            default_seed=self._seed_source.getrandbits(63),
            grammar=request.grammar,
        ))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End the request now and free its blocks; returns its final chunk if it was live."""
        req = self.scheduler.finish_request(request_id, "abort")
        if self.speculator is not None:
            self.speculator.release(request_id)
        return req.make_output() if req is not None else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        self._in_step = [r.request_id for r in self.scheduler.running]
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        self._in_step = [r.request_id for r in sched.scheduled]
        sampled, logprobs = self.runner.execute(sched, self.blocks)
        updated = self.scheduler.update_from_output(sched, sampled, logprobs)
        outputs = [o for o in (req.make_output() for req in updated) if o is not None]
        if self.speculator is not None:
            self.speculator.after_update(sched, sampled, time.perf_counter() - started)
            self.speculator.propose_next(self.scheduler)
        self._record_step(time.perf_counter() - started)
        return outputs

    def recover_from_failed_step(self) -> list[str]:
        """After `step` raised: end every request the step touched or that holds KV blocks, free their
        blocks and draft state, and return their ids (the caller fails their streams).

        Queued requests stay queued. Cached prefix blocks stay valid: a block is content-addressed only
        in `update_from_output`, after its forward completed. Raises if the block accounting does not
        come back to zero held blocks, where the engine cannot be trusted any more."""
        failed = list(dict.fromkeys([*self._in_step, *(r.request_id for r in self.scheduler.running)]))
        for request_id in failed:
            self.abort_request(request_id)
            self.blocks.free(request_id)  # also a request the step finished before it raised
        self._in_step = []
        self.step_failures_total += 1
        holders = [r.request_id for r in self.scheduler.running]
        if holders or self.blocks.num_used:
            raise RuntimeError(f"engine state inconsistent after a failed step: {self.blocks.num_used} KV blocks "
                               f"still held, running {holders[:5]}")
        return failed

    def _record_step(self, seconds: float) -> None:
        self.steps_total += 1
        self.step_time_total_s += seconds
        self.last_step_s = seconds
        self.recent_step_durations_s.append(seconds)

    # ---- counters -----------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        c = self.scheduler.counters
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            kv_blocks_used=self.blocks.num_used,
            kv_blocks_total=self.blocks.num_blocks,
            kv_block_size=self.block_size,
            prompt_tokens_total=c.prompt_tokens_total,
            generation_tokens_total=c.generation_tokens_total,
            preemptions_total=c.preemptions_total,
            requests_finished_total=c.requests_finished_total,
            prefix_cache_queries_total=c.prefix_cache_queries_total,
            prefix_cache_hits_total=c.prefix_cache_hits_total,
            step_failures_total=self.step_failures_total,
            steps_total=self.steps_total,
            step_time_total_s=self.step_time_total_s,
            last_step_s=self.last_step_s,
            recent_step_durations_s=list(self.recent_step_durations_s),
            spec=self.speculator.snapshot() if self.speculator is not None else SpecStats(),
        )
