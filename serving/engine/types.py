"""The engine's public data contract: what a request asks for and what it gets back.

Plain dataclasses with no torch import, so the server can import them cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]

# The bounds of a request's sampling fields, defined once: SamplingParams.validate checks them and the API's
# request schemas (serving/api/schemas.py) declare them.
TEMPERATURE_RANGE = (0.0, 2.0)
TOP_P_RANGE = (0.0, 1.0)  # (low, high]: a nucleus keeps some mass
MIN_TOP_K = -1  # -1 and 0: off
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty, frequency_penalty
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGPROBS = 20  # top-n of logprobs and prompt_logprobs
SEED_RANGE = (-(2**63), 2**63 - 1)  # what torch.Generator.manual_seed accepts as a signed 64-bit seed
# Below this a temperature divides logits to inf/nan (5e-324 -> 0 in fp32); it is argmax in all but name.
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 (or below MIN_TEMPERATURE) = greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept, (0, 1]; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = off
    seed: int | None = None  # seeds this request's own generator; None = random
    max_tokens: int = 16  # generated tokens at most
    stop: list[str] = field(default_factory=list)  # stop strings, cut from the returned text
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop ids, besides the model's EOS
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    logprobs: int | None = None  # top-n logprobs per generated token; None = none, 0 = sampled token only
    speculative: bool = True  # per-request opt-out of speculative decoding
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence from the logit of every generated token
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    prompt_logprobs: int | None = None  # top-n logprobs at every prompt position; None = none, 0 = token only

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        if not TEMPERATURE_RANGE[0] <= self.temperature <= TEMPERATURE_RANGE[1]:
            raise ValueError(f"temperature must be between {TEMPERATURE_RANGE[0]:g} and {TEMPERATURE_RANGE[1]:g}, "
                             f"got {self.temperature}")
        if not TOP_P_RANGE[0] < self.top_p <= TOP_P_RANGE[1]:
            raise ValueError(f"top_p must be in ({TOP_P_RANGE[0]:g}, {TOP_P_RANGE[1]:g}], got {self.top_p}")
        if self.top_k < MIN_TOP_K:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise ValueError(f"max_tokens must be >= 1 (0 only with prompt_logprobs), got {self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not PENALTY_RANGE[0] <= getattr(self, name) <= PENALTY_RANGE[1]:
                raise ValueError(f"{name} must be between {PENALTY_RANGE[0]:g} and {PENALTY_RANGE[1]:g}, "
                                 f"got {getattr(self, name)}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
            if not LOGIT_BIAS_RANGE[0] <= bias <= LOGIT_BIAS_RANGE[1]:
                raise ValueError(f"logit_bias[{token}] must be between {LOGIT_BIAS_RANGE[0]:g} and "
                                 f"{LOGIT_BIAS_RANGE[1]:g}, got {bias}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be between {SEED_RANGE[0]} and {SEED_RANGE[1]}, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a logit bias change the logits before sampling (see engine/logits.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # an xgrammar CompiledGrammar (serving/engine/grammar.py, compiled off the engine loop) the output must follow
    grammar: object | None = None


@dataclass
class TokenLogprobs:
    token_id: int  # the generated token
    logprob: float  # its log-probability under the model (raw logits, before temperature/top-k/top-p)
    top_logprobs: list[tuple[int, float]]  # the n most likely (token_id, logprob), best first


@dataclass
class RequestOutput:
    """One incremental chunk of a request's output."""

    request_id: str
    new_token_ids: list[int]  # tokens generated since the previous chunk
    new_text: str  # their text, incrementally detokenized, stop strings already cut
    finished: bool
    finish_reason: FinishReason | None  # set on the last chunk
    num_prompt_tokens: int
    num_generated_tokens: int  # total so far, this chunk included
    logprobs: list[TokenLogprobs] | None = None  # one per new token when the request asked for logprobs
    stop_reason: str | int | None = None  # the stop string or token id that ended it, if any
    arrival_time: float = 0.0  # time.monotonic() when the engine accepted the request
    first_token_time: float | None = None  # time.monotonic() of the first generated token
    # with params.prompt_logprobs, on the first chunk: one per prompt token (None for the first, which has no
    # context to be predicted from)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


RejectionKind = Literal["never_fits", "queue_full", "invalid", "unavailable"]


class RequestRejected(Exception):
    """Admission refused a request.

    kind "never_fits" / "invalid" → HTTP 400 (the request itself is wrong, the message says the numbers);
    "queue_full" / "unavailable" → 429 / 503 (retry later).
    """

    def __init__(self, kind: RejectionKind, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.kind: RejectionKind = kind
        self.reason = message
        self.param = param  # the request field at fault, where one is (the API's error names it)

    @property
    def retryable(self) -> bool:
        return self.kind in ("queue_full", "unavailable")


class EngineDeadError(RuntimeError):
    """The step loop failed; the engine serves nothing more. The cause is chained."""


class StepFailedError(RuntimeError):
    """An engine step raised while this request was in it: the request ends, the engine goes on.

    Every request that held KV blocks at that moment fails this way (the step's effect on each is
    unknown); requests still queued are untouched. Repeated failures make the engine dead instead."""


@dataclass
class SpecStats:
    """Speculative decoding counters (all zero while speculation is off)."""

    num_drafts: int = 0  # verification rounds with at least one draft token
    num_draft_tokens: int = 0  # draft tokens proposed and verified
    num_accepted_tokens: int = 0  # draft tokens accepted
    accepted_per_position: list[int] = field(default_factory=list)  # index i: drafts accepted at position i
    k_histogram: dict[int, int] = field(default_factory=dict)  # chosen k -> sequences-steps
    rejected_verify_time_s: float = 0.0  # estimated verify time spent on rejected tokens
    # the adaptive guard (spec/guard.py; all zero with a fixed k): the decoding steps it decided, those it ran
    # without drafts because drafting measured slower at that load, those it ran without drafts to measure plain
    # decoding, and the times a load turned speculation off
    guard_cycles: int = 0
    guard_vetoed_cycles: int = 0
    guard_plain_cycles: int = 0
    guard_vetoes: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        # tokens emitted per verification round: accepted drafts + the bonus/correction token
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts if self.num_drafts else 0.0


@dataclass
class EngineStats:
    """A snapshot of the engine's counters; totals are monotonic since start."""

    num_waiting: int  # requests queued, not yet scheduled (preempted ones included)
    num_running: int  # requests holding KV blocks
    kv_blocks_used: int
    kv_blocks_total: int
    kv_block_size: int
    prompt_tokens_total: int  # prompt tokens prefilled (recomputation after preemption included)
    generation_tokens_total: int  # tokens generated
    preemptions_total: int
    requests_finished_total: int
    steps_total: int
    step_time_total_s: float
    last_step_s: float
    recent_step_durations_s: list[float]  # the last few hundred step durations, oldest first
    spec: SpecStats = field(default_factory=SpecStats)
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits_total: int = 0  # of which found cached (their prefill skipped)
    step_failures_total: int = 0  # steps that raised and were recovered (their requests failed)
