"""Speculation inside the engine step: propose drafts for the next step, verify drafts of this one.

    step t:   schedule (running requests carry their drafts) → forward (last token + drafts per
              speculating sequence, next to other sequences' prefill and decode tokens) → verify →
              update (rejected drafts rolled back in the target cache) → propose drafts for step t + 1
"""

from __future__ import annotations

import torch

from serving.engine.config import SpeculativeConfig
from serving.engine.request import Request
from serving.engine.sampling import SamplingRows, logits_to_probs
from serving.engine.scheduler import Scheduler, SchedulerOutput
from serving.engine.spec.draft import DraftModelProposer
from serving.engine.spec.ngram import NgramProposer
from serving.engine.spec.policy import SpeculationPolicy
from serving.engine.spec.rejection import rejection_sample, verify_greedy
from serving.engine.types import SpecStats


def amortized_catch_up(lag: int, req: Request) -> float:
    """The draft's catch-up (its whole prompt, the first time) is paid once and serves every later step of the
    request: charge this step only its share over the steps still to come (~2 tokens each), or a request
    whose draft lags would never look worth catching up and would never speculate."""
    remaining_steps = max((req.params.max_tokens - req.num_output_tokens) / 2, 1.0)
    return 1 + (lag - 1) / remaining_steps


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: NgramProposer | DraftModelProposer,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = SpeculationPolicy(max_k=config.num_draft_tokens, adaptive=config.adaptive,
                                        uses_draft_model=isinstance(proposer, DraftModelProposer))
        self.stats = SpecStats(accepted_per_position=[0] * config.num_draft_tokens)
        self._draft_probs: dict[str, torch.Tensor] = {}  # req_id -> q [k, vocab] of sampled draft tokens

    # ---- proposing ----------------------------------------------------------------------------------

    def propose_next(self, scheduler: Scheduler) -> None:
        """Give every decoding request that may speculate its draft tokens for the next step."""
        decoding = [r for r in scheduler.running if r.num_computed_tokens == r.num_tokens - 1 and not r.is_finished]
        candidates = {}
        for req in decoding:
            # a verification of k drafts emits up to k + 1 tokens: no drafts past max_tokens or the context
            cap = min(self.config.num_draft_tokens, req.params.max_tokens - req.num_output_tokens - 1,
                      self.max_model_len - req.num_tokens - 1)
            if req.params.speculative and cap > 0:
                candidates[req.request_id] = cap
        if not candidates:
            return
        prefilling = sum(r.num_tokens - r.num_computed_tokens for r in scheduler.running if r not in decoding)
        prefilling += sum(r.num_tokens for r in scheduler.waiting)
        other_tokens = min(prefilling, max(self.max_num_batched_tokens - len(decoding), 0))
        by_id = {r.request_id: r for r in decoding}

        if isinstance(self.proposer, NgramProposer):
            proposals = self.proposer.propose({rid: by_id[rid].all_token_ids for rid in candidates}, candidates)
            ks = self.policy.choose({rid: len(d) for rid, d in proposals.items()}, other_tokens, len(decoding))
            for rid, drafts in proposals.items():
                by_id[rid].spec_token_ids = drafts[: ks[rid]]
        else:
            catch_up = {rid: amortized_catch_up(self.proposer.lag(by_id[rid]), by_id[rid]) for rid in candidates}
            ks = self.policy.choose(candidates, other_tokens, len(decoding), catch_up)
            ks = {rid: k for rid, k in ks.items() if k > 0}
            proposed = self.proposer.propose([by_id[rid] for rid in ks], ks)
            for num_seqs, seconds in proposed.forward_seconds:
                self.policy.observe_draft_forward(num_seqs, seconds)
            for rid, tokens in proposed.tokens.items():
                by_id[rid].spec_token_ids = tokens
            self._draft_probs.update(proposed.probs)
        for rid in candidates:
            k = len(by_id[rid].spec_token_ids)
            self.stats.k_histogram[k] = self.stats.k_histogram.get(k, 0) + 1

    # ---- verifying ----------------------------------------------------------------------------------

    def verify(self, reqs: list[Request], drafts: list[list[int]], logits: torch.Tensor) -> list[list[int]]:
        """logits [sum(len(d) + 1), vocab]: each request's rows in order; returns the tokens each emits."""
        starts = [0]
        for d in drafts:
            starts.append(starts[-1] + len(d) + 1)
        out: list[list[int]] = []
        if all(r.params.greedy for r in reqs):
            argmax = logits.argmax(dim=-1).tolist()
            return [verify_greedy(argmax[starts[i] : starts[i + 1]], d) for i, d in enumerate(drafts)]
        row_params = [r.params for r, d in zip(reqs, drafts, strict=True) for _ in range(len(d) + 1)]
        probs = logits_to_probs(logits, SamplingRows.from_params(row_params, logits.shape[-1], logits.device))
        for i, (req, d) in enumerate(zip(reqs, drafts, strict=True)):
            p = probs[starts[i] : starts[i + 1]]
            if req.params.greedy:
                out.append(verify_greedy(p.argmax(dim=-1).tolist(), d))
                continue
            q = self._draft_probs.pop(req.request_id, None)
            out.append(rejection_sample(p, d, q[: len(d)] if q is not None else None, req.generator))
        return out

    # ---- bookkeeping --------------------------------------------------------------------------------

    def after_update(self, sched: SchedulerOutput, sampled: dict[str, list[int]], step_seconds: float) -> None:
        self.policy.observe_target_step(sched.total_num_scheduled_tokens, step_seconds)
        for rid in sched.preempted_ids:
            self.release(rid)
        for req in sched.scheduled:
            drafts = sched.spec_token_ids.get(req.request_id)
            if drafts:
                accepted = len(sampled.get(req.request_id, [])) - 1
                self._record_verification(req.request_id, accepted, len(drafts))
            if req.is_finished:
                self.release(req.request_id)
            elif isinstance(self.proposer, DraftModelProposer):
                self.proposer.rollback(req.request_id, req.num_computed_tokens)

    def _record_verification(self, req_id: str, accepted: int, drafted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += drafted
        s.num_accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_position[i] += 1
        s.rejected_verify_time_s += (drafted - accepted) * self.policy.target_cost.slope
        self.policy.observe_verification(req_id, accepted, drafted)

    def release(self, req_id: str) -> None:
        """The request left the running set (finished, aborted or preempted): drop its draft state."""
        self._draft_probs.pop(req_id, None)
        self.policy.forget(req_id)
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.release(req_id)
