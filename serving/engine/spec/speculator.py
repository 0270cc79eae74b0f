"""Speculation inside the engine step: propose drafts for the next step, verify drafts of this one.

    step t:   schedule (running requests carry their drafts) → forward (last token + drafts per
              speculating sequence, next to other sequences' prefill and decode tokens) → verify →
              update (rejected drafts rolled back in the target cache) → propose drafts for step t + 1
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch

from serving.engine.config import SpeculativeConfig
from serving.engine.grammar import mask_verify_rows
from serving.engine.logits import adjust_logits
from serving.engine.request import Request
from serving.engine.sampling import SamplingRows, greedy_tokens, logits_to_probs, position_noise, race
from serving.engine.scheduler import Scheduler, SchedulerOutput
from serving.engine.spec.guard import SpeculationGuard
from serving.engine.spec.policy import EARLY_OUTPUTS, SpeculationPolicy
from serving.engine.spec.proposer import Proposals, Proposer
from serving.engine.spec.rejection import accept_drafts, rejection_sample
from serving.engine.types import SpecStats


def amortized_catch_up(lag: int, req: Request) -> float:
    """The draft's catch-up (its whole prompt, the first time) is paid once and serves every later step of the
    request: charge this step only its share over the steps still to come (~2 tokens each), or a request
    whose draft lags would never look worth catching up and would never speculate."""
    remaining_steps = max((req.params.max_tokens - req.num_output_tokens) / 2, 1.0)
    return 1 + (lag - 1) / remaining_steps


def _decoding(req: Request) -> bool:
    """Whether req's next step decodes (its prompt computed, one token to feed): it may carry drafts."""
    return req.num_computed_tokens == req.num_tokens - 1 and not req.is_finished


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.policy = SpeculationPolicy(max_k=config.num_draft_tokens, adaptive=config.adaptive,
                                        uses_draft_model=proposer.uses_model)
        self.stats = SpecStats(accepted_per_position=[0] * config.num_draft_tokens)
        self._draft_probs: dict[str, torch.Tensor] = {}  # req_id -> q [k, vocab], verified by rejection sampling
        self._drafted: set[str] = set()  # requests that have drafted: their draft has caught up once
        self._ahead: set[str] = set()  # requests that drafted since their last rollback (after_update)
        self._early: set[str] = set()  # requests whose current drafts were proposed early (EARLY_OUTPUTS)
        self._bookkeeping_seconds = 0.0  # this step's after_update, charged with the next proposals
        # adaptive: the policy's choices held against the clock (guard.py); a fixed k is what the operator asked for
        self.guard = SpeculationGuard() if config.adaptive else None
        self._cycle: tuple[float, int, bool] | None = None  # the cycle under way: (start, running, policy decided)
        self._cycle_tokens: int | None = None  # tokens its step emitted; None where it also prefilled or preempted
        self._cycle_drafting_s = 0.0  # what its proposal took (the policy, catch-ups, draft forwards)
        # called with SpeculationPolicy.describe() of every choice when set (bench spec --trace-policy)
        self.trace: Callable[[dict[str, object]], None] | None = None

    # ---- proposing ----------------------------------------------------------------------------------

    def propose_next(self, scheduler: Scheduler) -> None:
        """Give every decoding request that may speculate its draft tokens for the next step."""
        started = time.perf_counter()
        if self.guard is not None and self._cycle is not None:
            cycle_start, running, allowed = self._cycle
            if self._cycle_tokens is not None:
                self.guard.observe(running, allowed, self._cycle_tokens, started - cycle_start)
            elif allowed:  # its step also prefilled: no rate to compare, but what the drafting cost counts
                self.guard.charge(running, self._cycle_drafting_s)
        self._cycle = None
        # a step the guard runs plain should cost what a spec-off step does: the guard is asked as soon as one
        # candidate is found, and a vetoed step is spared the passes over every request that drafting needs
        if not any(self._cap(r) > 0 for r in scheduler.running if _decoding(r)):
            return
        # the guard's buckets count every running request: a wave of new requests is priced where it will decode
        if self.guard is not None and not self.guard.allows_drafting(len(scheduler.running)):
            self._cycle = (started, len(scheduler.running), False)
            return
        decoding = [r for r in scheduler.running if _decoding(r)]
        candidates = {r.request_id: cap for r in decoding if (cap := self._cap(r)) > 0}
        by_id = {r.request_id: r for r in decoding}
        alone = len(candidates) == 1
        lags = {rid: self.proposer.lag(by_id[rid]) for rid in candidates}
        catch_up = {rid: self._catch_up(by_id[rid], lags[rid], alone) for rid in candidates}

        # choose k first, then draft exactly that: a draft model's forwards cost, and so do the n-gram proposer's
        # lookups (~30 us a request: 1.9 ms a step at 64 sequences, when it drafted for every candidate first and
        # the policy then kept almost none). A lone sequence's drafts may cost one fixed amount for any k (a draft
        # model's compiled rollout). A request the n-gram proposer finds no match for drafts fewer than its k.
        flat = self.proposer.fixed_draft_seconds(by_id[next(iter(candidates))]) if len(candidates) == 1 else None
        early = {rid for rid in candidates if by_id[rid].num_output_tokens < EARLY_OUTPUTS}
        ks = self.policy.choose(candidates, len(decoding), catch_up, flat, lags, early)
        if self.guard is not None:  # a drafting cycle for the guard, whatever k the policy chose (guard.py)
            self._cycle = (started, len(scheduler.running), True)
        speculating = [by_id[rid] for rid, k in ks.items() if k > 0]
        self._early = early
        proposed = self.proposer.propose(speculating, ks)
        self._accept_proposals(proposed, by_id)
        for rid in candidates:
            k = len(by_id[rid].spec_token_ids)
            self.stats.k_histogram[k] = self.stats.k_histogram.get(k, 0) + 1
        # the speculator's own work this step, less the drafting the policy prices by itself
        self._cycle_drafting_s = time.perf_counter() - started
        work = self._bookkeeping_seconds + self._cycle_drafting_s - proposed.priced_seconds
        self.policy.observe_speculator_work(len(speculating), max(work, 0.0))
        if self.trace is not None:  # after the timing: a trace must not weigh on the speculator's own cost
            self.trace(self.policy.describe(candidates, len(decoding), catch_up, early, ks))

    def _cap(self, req: Request) -> int:
        """The most drafts req may verify next step (0: none). A verification of k drafts emits up to k + 1
        tokens: no drafts past max_tokens or the context."""
        if not req.params.speculative:
            return 0
        return min(self.config.num_draft_tokens, req.params.max_tokens - req.num_output_tokens - 1,
                   self.max_model_len - req.num_tokens - 1)

    def _catch_up(self, req: Request, lag: int, alone: bool) -> float:
        """Draft tokens to charge before the draft can draft for req. The first catch-up (the prompt) is
        amortized over the request. A request that drafted before and then sat out steps pays its whole lag
        now: amortized every step, the policy resumes a changing few requests at high load, each resumption a
        catch-up, and the engine runs below both always-k = 0 and always-k > 0. But charged its whole lag for
        good, a request set to k = 0 could never resume: its lag grows a token a step, and its exploration probe
        waits for a small catch-up, so one early rejection or a cost fit still carrying a busier load would
        leave a lone request without speculation. So the amortized charge comes back for a request that is the
        only candidate (it has nobody to churn with) and for one that has sat out the policy's exploration
        interval (one resumption per interval at most)."""
        if req.request_id in self._drafted and not alone and not self.policy.rested(req.request_id):
            return float(lag)
        return amortized_catch_up(lag, req)

    def _accept_proposals(self, proposed: Proposals, by_id: dict[str, Request]) -> None:
        for num_tokens, seconds in proposed.forward_seconds:
            self.policy.observe_draft_forward(num_tokens, seconds)
        for rid, tokens in proposed.tokens.items():
            if tokens:
                self._drafted.add(rid)
                self._ahead.add(rid)
            grammar = by_id[rid].grammar
            if grammar is not None and tokens:  # cut where the grammar rejects (lossless either way: grammar.py)
                tokens = grammar.admissible_drafts(tokens, sampled=rid in proposed.probs)
            by_id[rid].spec_token_ids = tokens
        self._draft_probs.update(proposed.probs)

    # ---- verifying ----------------------------------------------------------------------------------

    def verify(
        self, reqs: list[Request], drafts: list[list[int]], logits: torch.Tensor, rows: list[range]
    ) -> list[list[int]]:
        """rows[i]: request i's rows of the step's logits [rows, vocab] (its last real token, then one per
        draft), in order; returns the tokens each request emits."""
        verify_logits = logits[torch.tensor([row for r in rows for row in r], device=logits.device)]
        lengths = [len(r) for r in rows]
        if any(r.grammar is not None for r in reqs):  # row j masked after the drafts before j
            mask_verify_rows(verify_logits, [r.grammar for r in reqs], drafts)
        if any(r.params.adjusts_logits for r in reqs):  # (no history copies for the common case)
            # the row at draft position j is adjusted as plain sampling would be after the drafts before j
            verify_logits = adjust_logits(
                verify_logits,
                [r.params for r, n in zip(reqs, lengths, strict=True) for _ in range(n)],
                [r.output_token_ids + d[:j] for r, d, n in zip(reqs, drafts, lengths, strict=True) for j in range(n)],
            )
        if all(r.params.greedy for r in reqs):
            argmax = greedy_tokens(verify_logits).split(lengths)
            return [accept_drafts(a.tolist(), d) for a, d in zip(argmax, drafts, strict=True)]
        row_params = [r.params for r, n in zip(reqs, lengths, strict=True) for _ in range(n)]
        probs = logits_to_probs(verify_logits, SamplingRows.from_params(row_params, logits.shape[-1], logits.device))
        out: list[list[int]] = []
        for p, req, d in zip(probs.split(lengths), reqs, drafts, strict=True):
            q = self._draft_probs.pop(req.request_id, None)
            if q is not None:  # an unseeded request's model drafts: rejection sampling (rejection.py)
                out.append(rejection_sample(p, d, q[: len(d)], req.generator))
            elif req.params.greedy:
                out.append(accept_drafts(greedy_tokens(p).tolist(), d))
            else:  # the target's token at each row: its race on the noise of that output position (rejection.py)
                noise = position_noise([req.noise_key(j) for j in range(len(d) + 1)], p.shape[-1], p.device)
                out.append(accept_drafts(race(p, noise).tolist(), d))
        return out

    # ---- bookkeeping --------------------------------------------------------------------------------

    def after_update(self, sched: SchedulerOutput, sampled: dict[str, list[int]], step_seconds: float) -> None:
        started = time.perf_counter()
        self.policy.observe_target_step(sched.total_num_scheduled_tokens, step_seconds)
        for rid in sched.preempted_ids:
            self.release(rid)
        verified = []
        for rid, drafts in sched.spec_token_ids.items():
            accepted = len(sampled.get(rid, [])) - 1
            self._record_verification(accepted, len(drafts))
            verified.append((rid, accepted, len(drafts), rid in self._early))
        self.policy.observe_verifications(verified)  # before release() forgets the finished ones
        # the guard's cycle counts only if this step decoded and verified, nothing else: every scheduled request
        # ran at least its one token and its drafts, so the totals match only where each ran exactly those
        drafted = sum(len(d) for d in sched.spec_token_ids.values())
        clean = (not sched.preempted_ids
                 and sched.total_num_scheduled_tokens == len(sched.num_scheduled_tokens) + drafted)
        self._cycle_tokens = sum(len(tokens) for tokens in sampled.values()) if clean else None
        # only a proposal runs the proposer's state past the sequence (the draft's K/V of drafts the target may
        # reject): the requests that drafted since their last rollback are the ones that may need one, whether
        # their drafts were verified this step or the scheduler dropped them
        for req in sched.scheduled:
            if req.is_finished:
                self.release(req.request_id)
            elif req.request_id in self._ahead:
                self._ahead.discard(req.request_id)
                self.proposer.rollback(req.request_id, req.num_computed_tokens)
        self._bookkeeping_seconds = time.perf_counter() - started

    def snapshot(self) -> SpecStats:
        """A copy of the counters, the guard's included."""
        stats = copy.deepcopy(self.stats)
        if self.guard is not None:
            stats.guard_cycles = self.guard.cycles_total
            stats.guard_vetoed_cycles = self.guard.vetoed_cycles_total
            stats.guard_plain_cycles = self.guard.forced_plain_total
            stats.guard_vetoes = self.guard.vetoes_total
        return stats

    def _record_verification(self, accepted: int, drafted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += drafted
        s.num_accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_position[i] += 1
        s.rejected_verify_time_s += (drafted - accepted) * self.policy.target_cost.slope

    def release(self, req_id: str) -> None:
        """The request left the running set (finished, aborted or preempted): drop its draft state."""
        self._drafted.discard(req_id)
        self._ahead.discard(req_id)
        self._draft_probs.pop(req_id, None)
        self._early.discard(req_id)
        self.policy.forget(req_id)
        self.proposer.release(req_id)
