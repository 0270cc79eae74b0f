"""A request's state inside the engine: its tokens, how many are in the KV cache, and how it ends."""

from __future__ import annotations

import enum
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from serving.engine.detokenizer import IncrementalDetokenizer, Tokenizer
from serving.engine.types import FinishReason, RequestOutput, SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from serving.engine.grammar import RequestGrammar

log = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        eos_token_ids: list[int],
        max_model_len: int,
        tokenizer: Tokenizer | None,
        default_seed: int,
        grammar: Any | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.all_token_ids = list(prompt_token_ids)  # prompt + output
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V is in the cache
        self.spec_token_ids: list[int] = []  # draft tokens proposed for the next verification
        self.status = RequestStatus.WAITING
        self.max_model_len = max_model_len
        self.stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        # every random draw of output position t is a function of (seed, t): sampling.position_noise
        self.seed = params.seed if params.seed is not None else default_seed
        self._generator: torch.Generator | None = None
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop)
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        self._emitted_tokens = 0
        self._pending_logprobs: list[TokenLogprobs] = []
        # a compiled grammar (serving/engine/grammar.py) constrains the output; its matcher follows the output
        self.grammar: RequestGrammar | None = None
        if grammar is not None:
            from serving.engine.grammar import RequestGrammar

            self.grammar = RequestGrammar(grammar)
        # prompt token i's logprob at index i (the first has no context: None); filled chunk by chunk
        self.prompt_logprobs: list[TokenLogprobs | None] = [None]
        self._prompt_logprobs_sent = False

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are still to be scored (a recomputed prefill skips them)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def add_prompt_logprobs(self, first_position: int, entries: list[TokenLogprobs]) -> None:
        """Logprobs of prompt tokens first_position, first_position + 1, ...; positions already held are kept."""
        for position, entry in enumerate(entries, start=first_position):
            if position == len(self.prompt_logprobs):
                self.prompt_logprobs.append(entry)

    def noise_key(self, offset: int = 0) -> tuple[int, int]:
        """(seed, output position) of the token `offset` places after the last generated one."""
        return self.seed, self.num_output_tokens + offset

    @property
    def verifies_by_rejection(self) -> bool:
        """An unseeded sampled request: nothing to reproduce, so its model drafts are verified by rejection
        sampling, which accepts more of them than the coupled rule (spec/rejection.py)."""
        return self.params.seed is None and not self.params.greedy

    @property
    def generator(self) -> torch.Generator:
        """The rejection sampler's draws (unseeded requests only), from the request's default seed."""
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self.seed)
        return self._generator

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_tokens(self, token_ids: list[int], logprobs: list[TokenLogprobs] | None = None) -> None:
        """Append sampled tokens in order, stopping at the first that finishes the request."""
        if self.first_token_time is None and token_ids:
            self.first_token_time = time.monotonic()
        if self.params.max_tokens == 0:  # scoring only (prompt logprobs): the sampled token is not kept
            self.finish("length")
            return
        per_token_text = bool(self.params.stop)  # stop strings need the text after every token
        appended = 0
        for i, token in enumerate(token_ids):
            self.output_token_ids.append(token)
            self.all_token_ids.append(token)
            appended += 1
            if logprobs is not None:
                self._pending_logprobs.append(logprobs[i])
            stop_string = self.detokenizer.append([token]) if per_token_text else None
            if self.grammar is not None and not self.grammar.accept(token):
                # the masks make this unreachable; end the request rather than return ungrammatical output
                log.error("request %s: token %d is outside its grammar; aborting it", self.request_id, token)
                self.finish("abort")
            elif token in self.stop_token_ids or (self.grammar is not None and self.grammar.is_terminated):
                self.finish("stop", token)
            elif stop_string is not None:
                self.finish("stop", stop_string)
            elif self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= self.max_model_len:
                self.finish("length")
            if self.is_finished:
                break
        if not per_token_text:
            self.detokenizer.append(token_ids[:appended])

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def make_output(self) -> RequestOutput | None:
        """The chunk generated since the previous call, or None when there is nothing new."""
        new_tokens = self.output_token_ids[self._emitted_tokens :]
        if not new_tokens and not self.is_finished:
            return None
        self._emitted_tokens = self.num_output_tokens
        logprobs = None
        if self.params.logprobs is not None:
            logprobs, self._pending_logprobs = self._pending_logprobs, []
        prompt_logprobs = None
        if self.params.prompt_logprobs is not None and not self._prompt_logprobs_sent:
            prompt_logprobs, self._prompt_logprobs_sent = self.prompt_logprobs, True
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new_tokens,
            new_text=self.detokenizer.take_new_text(self.is_finished),
            finished=self.is_finished,
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_output_tokens,
            logprobs=logprobs,
            stop_reason=self.stop_reason,
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            prompt_logprobs=prompt_logprobs,
        )
