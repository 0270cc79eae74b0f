"""The speculator drives any proposer through the `Proposer` protocol, never by its concrete type."""

from __future__ import annotations

import ast
import inspect
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from serving.engine.compile import buckets_up_to
from serving.engine.config import SpeculativeConfig
from serving.engine.engine import LLMEngine
from serving.engine.request import Request
from serving.engine.scheduler import SchedulerOutput
from serving.engine.spec import speculator as speculator_module
from serving.engine.spec.draft import DraftModelProposer
from serving.engine.spec.ngram import NgramProposer
from serving.engine.spec.policy import EARLY_OUTPUTS
from serving.engine.spec.proposer import Proposals, Proposer
from serving.engine.spec.speculator import Speculator
from serving.engine.types import SamplingParams

K = 3


class OracleProposer:
    """Proposes the continuation it was told (the spec-off greedy output), so every draft is accepted; records
    what the speculator asks of it."""

    def __init__(self, uses_model: bool, continuations: dict[str, list[int]]) -> None:
        self.uses_model = uses_model
        self.continuations = continuations  # req_id -> prompt + the whole greedy output
        self.proposed: list[dict[str, int]] = []
        self.rollbacks: list[tuple[str, int]] = []
        self.released: list[str] = []

    def propose(self, reqs: list[Request], ks: dict[str, int]) -> Proposals:
        self.proposed.append({r.request_id: ks[r.request_id] for r in reqs})
        proposals = Proposals()
        for req in reqs:
            known = self.continuations[req.request_id]
            proposals.tokens[req.request_id] = known[req.num_tokens : req.num_tokens + ks[req.request_id]]
        return proposals

    def lag(self, req: Request) -> int:
        return 1

    def rollback(self, req_id: str, num_valid_tokens: int) -> None:
        self.rollbacks.append((req_id, num_valid_tokens))

    def release(self, req_id: str) -> None:
        self.released.append(req_id)


def test_both_proposers_implement_the_protocol(kit: Any, llama_dir: Path) -> None:
    draft = DraftModelProposer(kit.make_engine(llama_dir).model, num_blocks=4, block_size=16)
    for proposer in (NgramProposer(), draft):
        assert isinstance(proposer, Proposer)
        assert inspect.signature(proposer.propose).parameters.keys() == {"reqs", "ks"}
    assert draft.uses_model and not NgramProposer().uses_model


def test_ngram_takes_no_start_up_decision() -> None:
    proposer = NgramProposer()
    proposer.set_paged_attention(True)
    proposer.compile_steps(4, measure=False, whole_decode=None, backend="eager")
    assert proposer.prepare_rollout("auto", 4, "cpp") is None
    assert proposer.pack_weights("on", None) == [] and proposer.choose_attention("on", tensor_parallel=False) == []
    assert proposer.decisions() == []


def test_the_draft_takes_its_start_up_decisions_through_the_hooks(kit: Any, llama_dir: Path) -> None:
    draft = DraftModelProposer(kit.make_engine(llama_dir).model, num_blocks=8, block_size=16)
    draft.set_paged_attention(True)
    assert draft.model.paged_attention
    draft.set_paged_attention(False)

    rollout = draft.prepare_rollout("off", 4, "python")
    assert rollout is draft.rollout_decision and rollout is not None and not rollout.enabled and draft.rollout is None
    (packing,) = draft.pack_weights("off", None)
    assert (packing.model, packing.packed, packing.reason) == ("draft", False, "model.cpu_weight_packing is off")
    (packing,) = draft.pack_weights("on", "device cuda: packing is for CPU")  # the engine's reason is the draft's
    assert not packing.packed and packing.reason == "device cuda: packing is for CPU"
    (attention,) = draft.choose_attention("off", tensor_parallel=False)
    assert (attention.model, attention.kernel) == ("draft", False) and draft.builder.in_place_max_q == 0
    draft.compile_steps(2, measure=False, whole_decode=False, backend="eager")
    assert draft.compiled is not None and sorted(draft.compiled.graphs) == buckets_up_to(2)
    assert draft.decisions() == [("speculative.draft_token_map", "none", "the full vocabulary"),
                                 ("speculative.draft_context", "whole sequence", "the whole sequence"),
                                 ("speculative.draft_rollout", "off", "speculative.draft_rollout is off")]

    draft.rollout = object()  # type: ignore[assignment]  # a compiled rollout keeps the draft's weights plain
    (packing,) = draft.pack_weights("on", None)
    assert not packing.packed and "compiled rollout" in packing.reason


def test_the_speculator_never_asks_for_a_concrete_proposer_type() -> None:
    tree = ast.parse(inspect.getsource(speculator_module))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    isinstance_calls = [n for n in calls if getattr(n.func, "id", "") == "isinstance"]
    imported = {alias.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for alias in n.names}
    assert not isinstance_calls
    assert not imported & {"DraftModelProposer", "NgramProposer"}


@pytest.mark.parametrize("uses_model", [False, True], ids=["model-free", "model-based"])
def test_a_third_proposer_runs_through_the_engine(kit: Any, llama_dir: Path, uses_model: bool) -> None:
    prompts = kit.random_prompts([5, 9, 14], seed=3)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for _ in prompts]
    expected = kit.run_to_completion(kit.make_engine(llama_dir), prompts, params)

    engine: LLMEngine = kit.make_engine(llama_dir, speculative=SpeculativeConfig(
        enabled=True, method="ngram", num_draft_tokens=K, adaptive=False))
    oracle = OracleProposer(uses_model, {str(i): p + e for i, (p, e) in enumerate(zip(prompts, expected, strict=True))})
    engine.runner.speculator = Speculator(engine.config.speculative, oracle, engine.max_model_len)
    assert kit.run_to_completion(engine, prompts, params) == expected

    spec = engine.stats().spec
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens  # the oracle is right
    assert engine.speculator.policy.uses_draft_model is uses_model
    assert all(0 < k <= K for asked in oracle.proposed for k in asked.values())
    assert oracle.rollbacks  # verified sequences were rolled back to what the target kept...
    assert sorted(oracle.released) == ["0", "1", "2"]  # ...and every finished request was released


class _Recording:
    """A proposer that drafts the same token and records which requests it was asked to draft for."""

    def __init__(self, uses_model: bool, lag: int = 1) -> None:
        self.uses_model = uses_model
        self.asked: list[list[str]] = []
        self.lag_tokens = lag

    def propose(self, reqs: list[Request], ks: dict[str, int]) -> Proposals:
        self.asked.append([r.request_id for r in reqs])
        return Proposals({r.request_id: [1] * ks[r.request_id] for r in reqs})

    def lag(self, req: Request) -> int:
        return self.lag_tokens

    def fixed_draft_seconds(self, req: Request) -> float | None:
        return None

    def rollback(self, req_id: str, num_tokens: int) -> None:
        pass

    def release(self, req_id: str) -> None:
        pass


def _decoding(n: int, outputs: list[int] | None = None) -> Any:
    """A scheduler stand-in with n requests decoding (their prompt computed, one token to go); request i has
    outputs[i] output tokens already (default none)."""
    reqs = []
    for i in range(n):
        req = Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=64), eos_token_ids=[],
                      max_model_len=512, tokenizer=None, default_seed=0)
        req.append_output_tokens([9] * (outputs[i] if outputs else 0))
        req.num_computed_tokens = req.num_tokens - 1
        reqs.append(req)

    class _Scheduler:
        running = reqs
        waiting: list[Request] = []

    return _Scheduler(), reqs


@pytest.mark.parametrize("uses_model", [True, False])
def test_a_proposer_drafts_only_for_the_requests_the_policy_chose(uses_model: bool) -> None:
    """The n-gram proposer too is asked after the policy has chosen: its lookups cost (~30 us a request), and at
    64 sequences drafting for every candidate first cost 1.9 ms a step for drafts the policy then dropped."""
    proposer = _Recording(uses_model)
    speculator = Speculator(SpeculativeConfig(enabled=True, method="ngram", num_draft_tokens=4), proposer, 512)
    scheduler, reqs = _decoding(6)
    speculator.policy.choose = lambda candidates, *a, **k: {r: (2 if r in ("r1", "r4") else 0)  # type: ignore
                                                              for r in candidates}
    speculator.propose_next(scheduler)  # type: ignore[arg-type]
    assert proposer.asked == [["r1", "r4"]]
    assert [len(r.spec_token_ids) for r in reqs] == [0, 2, 0, 0, 2, 0]


def _charges(lag: int, num_requests: int, chosen: Callable[[str], int]) -> tuple[Speculator, Any, list[Request],
                                                                            list[dict[str, float]]]:
    """A speculator over num_requests decoding requests whose draft lags `lag` tokens, with a policy that gives
    each request chosen(req_id) drafts and records the catch-up it was charged, step by step."""
    proposer = _Recording(uses_model=True, lag=lag)
    speculator = Speculator(SpeculativeConfig(enabled=True, method="ngram", num_draft_tokens=4), proposer, 512)
    scheduler, reqs = _decoding(num_requests)
    seen: list[dict[str, float]] = []

    def choose(candidates: dict[str, int], decodes: int, catch_up: dict[str, float],
               flat: float | None = None, lags: dict[str, int] | None = None,
               early: set[str] | frozenset[str] = frozenset()) -> dict[str, int]:
        seen.append(dict(catch_up))
        return {r: chosen(r) for r in candidates}

    speculator.policy.choose = choose  # type: ignore[method-assign,assignment]
    return speculator, scheduler, reqs, seen


def _verified_and_proposed_again(speculator: Speculator, scheduler: Any, reqs: list[Request]) -> None:
    for r in reqs:
        r.spec_token_ids = []
    speculator.propose_next(scheduler)


def test_a_request_resuming_after_idle_steps_is_charged_its_whole_catch_up() -> None:
    """The first catch-up (the prompt) is amortized over the request; once it has drafted, sitting out steps
    and resuming costs the whole lag at once, and the policy is told so."""
    speculator, scheduler, reqs, seen = _charges(9, 2, lambda r: 1 if r == "r0" else 0)
    speculator.propose_next(scheduler)
    _verified_and_proposed_again(speculator, scheduler, reqs)
    first = speculator_module.amortized_catch_up(9, reqs[0])
    assert first < 9 and seen[0]["r0"] == pytest.approx(first)
    assert seen[1] == {"r0": 9.0, "r1": pytest.approx(speculator_module.amortized_catch_up(9, reqs[1]))}
    speculator.release("r0")  # a new request under the same id starts amortized again
    speculator.propose_next(scheduler)
    assert seen[2]["r0"] < 9


def test_a_lone_request_that_sat_out_is_charged_the_amortized_catch_up_so_it_can_resume() -> None:
    """With nobody to churn with, the whole-lag rule only kept a lone request from ever speculating again after
    one k = 0 step (its lag grew a token a step, and its probe waits for a small catch-up): measured, 2 of 5
    c=1 runs after a 16-sequence run ran at ~490 tokens/s with speculation in 1 % of steps."""
    speculator, scheduler, reqs, seen = _charges(40, 1, lambda r: 1)
    speculator.propose_next(scheduler)  # drafts once, then (its drafts verified) is a candidate again, 40 behind
    _verified_and_proposed_again(speculator, scheduler, reqs)
    amortized = speculator_module.amortized_catch_up(40, reqs[0])
    assert amortized < 40 and seen[1]["r0"] == pytest.approx(amortized)


def test_a_request_set_to_k0_resumes_once_it_has_sat_out_the_exploration_interval() -> None:
    """The real policy, two requests whose draft lags 40 tokens: they draft (the first catch-up amortized), a
    costly stretch sets them to k = 0, and the costs come back down. Charged their whole lag (80 draft tokens,
    ~17 ms against a 5 ms step) they would never resume, and their probes never fire (40 > 8); after
    explore_after idle steps they are charged the amortized share again and speculate."""
    proposer = _Recording(uses_model=True, lag=40)
    speculator = Speculator(SpeculativeConfig(enabled=True, method="ngram", num_draft_tokens=4), proposer, 512)
    speculator.guard = None  # the policy's rule alone: the guard's plain cycles would not consult it (test_guard.py)
    scheduler, reqs = _decoding(2)
    policy = speculator.policy
    for tokens in (1, 2, 4, 8, 16, 32):
        policy.observe_target_step(tokens, 0.004 + 0.0001 * tokens)
        policy.observe_draft_forward(tokens, 0.001 + 0.0002 * tokens)
    for _ in range(10):
        policy.observe_verification("r0", 4, 4)
        policy.observe_verification("r1", 4, 4)
    cheap = (policy.target_cost.intercept, policy.target_cost.slope)

    speculator.propose_next(scheduler)
    assert all(r.spec_token_ids for r in reqs)  # the prompt's catch-up, amortized: both draft
    policy.target_cost.intercept, policy.target_cost.slope = 0.0, 1.0  # a verify token now costs a second
    resumed_after = None
    for step in range(1, 3 * policy.explore_after):
        _verified_and_proposed_again(speculator, scheduler, reqs)
        if step == 1:
            assert not any(r.spec_token_ids for r in reqs)
            policy.target_cost.intercept, policy.target_cost.slope = cheap
        if any(r.spec_token_ids for r in reqs):
            resumed_after = step
            break
    assert resumed_after == policy.explore_after + 1  # the whole lag until then; the amortized share after
    assert all(len(r.spec_token_ids) > 0 for r in reqs)


class _Slow(_Recording):
    """Proposes after `seconds` of work per request, reported as draft forwards or not."""

    def __init__(self, seconds: float, as_forwards: bool) -> None:
        super().__init__(uses_model=True)
        self.seconds, self.as_forwards = seconds, as_forwards

    def propose(self, reqs: list[Request], ks: dict[str, int]) -> Proposals:
        started = time.perf_counter()
        time.sleep(self.seconds * len(reqs))
        proposals = super().propose(reqs, ks)
        if self.as_forwards:
            proposals.forward_seconds.append((len(reqs), time.perf_counter() - started))
        return proposals


@pytest.mark.parametrize("as_forwards", [False, True])
def test_the_speculators_own_work_per_sequence_is_measured_apart_from_draft_forwards(as_forwards: bool) -> None:
    """Work a proposer does outside the forwards it reports (bookkeeping, lookups) is fitted per speculating
    sequence for the policy; forwards are priced by the draft cost line and not counted twice."""
    proposer = _Slow(0.004, as_forwards)
    speculator = Speculator(SpeculativeConfig(enabled=True, method="ngram", num_draft_tokens=4), proposer, 512)
    scheduler, reqs = _decoding(6)
    step = iter(range(1000))

    def choose(candidates: dict[str, int], *args: Any, **kwargs: Any) -> dict[str, int]:
        m = next(step) % 7  # 0 .. 6 sequences speculate
        return {r: (1 if i < m else 0) for i, r in enumerate(sorted(candidates))}

    speculator.policy.choose = choose  # type: ignore[method-assign]
    for _ in range(21):
        _verified_and_proposed_again(speculator, scheduler, reqs)
    slope = speculator.policy.sequence_cost.slope
    if as_forwards:
        assert slope < 0.001
    else:
        assert 0.0035 < slope < 0.006


def test_the_speculator_marks_drafts_proposed_before_early_outputs_tokens_as_early() -> None:
    """Drafts proposed before a request's EARLY_OUTPUTS-th output token reach the policy as early, both when it
    chooses k and when their verification is observed (SpeculationPolicy.observe_verifications)."""
    speculator = Speculator(SpeculativeConfig(enabled=True, method="ngram", num_draft_tokens=4),
                            _Recording(uses_model=False), 512)
    scheduler, reqs = _decoding(2, [EARLY_OUTPUTS - 1, EARLY_OUTPUTS])
    seen: list[set[str]] = []
    verified: list[Any] = []

    def choose(candidates: dict[str, int], *args: Any, **kwargs: Any) -> dict[str, int]:
        seen.append(set(args[4]))  # (num_decodes, catch_up, flat, lags, early)
        return dict.fromkeys(candidates, 2)

    speculator.policy.choose = choose  # type: ignore[method-assign]
    speculator.policy.observe_verifications = verified.extend  # type: ignore[method-assign,assignment]
    speculator.propose_next(scheduler)
    assert seen == [{"r0"}]
    drafts = {r.request_id: r.spec_token_ids for r in reqs}
    sched = SchedulerOutput(reqs, {r.request_id: 3 for r in reqs}, drafts, 6, 0)
    speculator.after_update(sched, {"r0": [1, 4], "r1": [1, 1, 4]}, 0.005)  # r0: 1 of 2 accepted, r1: 2 of 2
    assert verified == [("r0", 1, 2, True), ("r1", 2, 2, False)]


def test_the_speculator_traces_each_choice_when_asked() -> None:
    speculator = Speculator(SpeculativeConfig(enabled=True, method="ngram", num_draft_tokens=4),
                            _Recording(uses_model=False), 512)
    scheduler, reqs = _decoding(3, [4, 4, 4])
    speculator.policy.choose = lambda candidates, *a, **k: {r: (2 if r == "r1" else 0)  # type: ignore
                                                              for r in candidates}
    speculator.propose_next(scheduler)  # no trace set: nothing to call
    traced: list[dict[str, object]] = []
    speculator.trace = traced.append
    _verified_and_proposed_again(speculator, scheduler, reqs)
    assert len(traced) == 1
    assert traced[0]["candidates"] == 3 and traced[0]["k"] == {0: 2, 2: 1} and traced[0]["early"] == 0
