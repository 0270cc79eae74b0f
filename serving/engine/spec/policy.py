"""How many draft tokens each sequence verifies this step: chosen for goodput, 0 included.

Costs are measured, not assumed: the target's step time is fitted online as a + b * tokens (a: per-step
overhead, b: per-token work), the draft's as c + d * tokens per draft forward. Acceptance is tracked
per request and globally (exponentially decayed, once per engine step), and apart for the drafts a request
proposes before its second output token, which are accepted far less often. With per-token acceptance
alpha, k drafts yield (1 - alpha^(k+1)) / (1 - alpha) tokens in expectation. For each candidate k the policy estimates

    goodput(k) = expected tokens of all sequences / (target step time + k draft forwards)

and takes the best. A sequence that speculates also costs the engine work outside both forwards: its
proposal (an n-gram lookup, a draft's block bookkeeping) and its verification's bookkeeping. That is fitted
too, as seconds per speculating sequence, and charged once per sequence given a first draft position: at high
load the lookups and bookkeeping of many speculating sequences are a real share of what their verify tokens
cost, and the two forward lines alone overrate speculation there. At low load the step is overhead-bound
(a dominates), verifying k extra tokens is nearly free and speculation wins; as the batch fills, b * tokens
dominates, extra verify tokens cost as much as they earn and k falls to 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np


@dataclass
class LinearCost:
    """Online least squares fit of seconds = intercept + slope * x with exponential forgetting, robust to a lone
    slow observation.

    Once the fit has a few points, an observation is clipped to 3 typical misses of the line (an exponentially
    averaged absolute residual) before it enters the sums. Unclipped, one slow step can set the slope by itself
    (a batch's first verify step, run right after another process had the CPU's caches, at several times the
    line): the steps after it share one x, a line through two clusters ignores their weights, the slope stays
    high and nothing drafts for the rest of the run. A real change of cost still comes through: each clipped
    miss widens the limit by up to 20 %."""

    intercept: float
    slope: float
    decay: float = 0.98
    _scale: float = 0.0  # typical absolute residual, exponentially averaged
    _n: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0

    def observe(self, x: float, seconds: float) -> None:
        predicted = self(x)
        if self._n >= 8:
            limit = 3.0 * self._scale
            seconds = min(max(seconds, predicted - limit), predicted + limit)
        miss = abs(seconds - predicted)
        self._scale = miss if self._n == 0 else 0.9 * self._scale + 0.1 * miss
        d = self.decay
        self._n = d * self._n + 1
        self._sx = d * self._sx + x
        self._sy = d * self._sy + seconds
        self._sxx = d * self._sxx + x * x
        self._sxy = d * self._sxy + x * seconds
        var = self._n * self._sxx - self._sx**2
        if self._n >= 4 and var > 1e-9 * max(self._n * self._sxx, 1.0):
            slope = (self._n * self._sxy - self._sx * self._sy) / var
            intercept = (self._sy - slope * self._sx) / self._n
            if slope >= 0 and intercept >= 0:
                self.slope, self.intercept = slope, intercept
                return
        # not enough spread in x yet: keep the slope, move the intercept toward the observation
        self.intercept = max(0.9 * self.intercept + 0.1 * (seconds - self.slope * x), 0.0)

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x


@dataclass
class Acceptance:
    """Per-token acceptance probability, decayed counts of accepted / tested draft positions."""

    accepted: float = 0.0
    tested: float = 0.0
    prior: float = 0.6
    prior_weight: float = 2.0
    decay: float = 0.95

    def observe(self, accepted: int, drafted: int) -> None:
        self.observe_step([(accepted, drafted)])

    def observe_step(self, verifications: list[tuple[int, int]]) -> None:
        """One engine step's verifications, (accepted, drafted) each: old counts fade once for the step, however
        many sequences verified in it."""
        self.accepted *= self.decay
        self.tested *= self.decay
        for accepted, drafted in verifications:
            self.accepted += accepted
            self.tested += accepted + (1 if accepted < drafted else 0)  # after the first rejection: not tested

    def relax(self) -> None:
        """One step without evidence: old counts fade, so the estimate drifts back toward the prior instead
        of freezing at whatever the last (perhaps overloaded) verifications said."""
        self.accepted *= self.decay
        self.tested *= self.decay

    @property
    def rate(self) -> float:
        return (self.accepted + self.prior * self.prior_weight) / (self.tested + self.prior_weight)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens emitted by one verification of k drafts with per-token acceptance alpha (bonus included)."""
    if k == 0:
        return 1.0
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


# drafts proposed while a request has fewer output tokens than this are early (SpeculationPolicy.observe_verifications)
EARLY_OUTPUTS = 2


@dataclass
class SpeculationPolicy:
    max_k: int
    adaptive: bool = True
    uses_draft_model: bool = True
    target_cost: LinearCost = field(default_factory=lambda: LinearCost(intercept=5e-3, slope=1e-4))
    draft_cost: LinearCost = field(default_factory=lambda: LinearCost(intercept=1e-3, slope=2e-5))
    # seconds of the speculator's own work (proposing, bookkeeping; draft forwards excluded) against the number
    # of sequences that speculate: only the slope is charged, the intercept is paid whatever the choice
    sequence_cost: LinearCost = field(default_factory=lambda: LinearCost(intercept=1e-4, slope=1e-5))
    global_acceptance: Acceptance = field(default_factory=Acceptance)
    # the pair's acceptance over the last ~1,000 verifications: what an idle global estimate relaxes toward
    long_run_acceptance: Acceptance = field(default_factory=lambda: Acceptance(decay=0.999))
    per_request: dict[str, Acceptance] = field(default_factory=dict)
    # verifications of drafts proposed before a request had EARLY_OUTPUTS output tokens: a population of their own
    early_acceptance: Acceptance = field(default_factory=Acceptance)
    explore_after: int = 32  # a request left at k = 0 this many steps gets one k = 1 probe
    _idle_steps: dict[str, int] = field(default_factory=dict)
    _steps_without_drafts: int = 0  # across all requests: short requests never reach their own probe

    def global_rate(self) -> float:
        """The recent acceptance of every request together, anchored at the pair's long-run rate (never below
        the prior): while nobody drafts the recent counts fade and the estimate returns to that anchor. Anchored
        at the fixed prior (0.6) alone, a draft pair accepting ~0.94 that sat out a stretch came back looking like
        0.6, too poor to speculate with at 16 sequences, so it never drafted again to correct the estimate (seen:
        a 16-sequence run starting from 0.60 after a 4-sequence one, k = 0 throughout)."""
        recent = self.global_acceptance
        anchor = max(recent.prior, self.long_run_acceptance.rate)
        return (recent.accepted + anchor * recent.prior_weight) / (recent.tested + recent.prior_weight)

    def early_rate(self, global_rate: float | None = None) -> float:
        """Acceptance of a request's early drafts (EARLY_OUTPUTS), leaning on the global rate for a verification's
        worth of positions until early verifications say otherwise."""
        prior = self.global_rate() if global_rate is None else global_rate
        early = self.early_acceptance
        return (early.accepted + prior * self.max_k) / (early.tested + self.max_k)

    def acceptance(self, req_id: str, global_rate: float | None = None, early: bool = False) -> float:
        """A request's own history, with the global rate (computed here unless given) as its prior; for drafts
        proposed early in the request (EARLY_OUTPUTS), the rate of early drafts."""
        prior = self.global_rate() if global_rate is None else global_rate
        if early:
            return self.early_rate(prior)
        own = self.per_request.get(req_id)
        if own is None:
            return prior
        return (own.accepted + prior * own.prior_weight) / (own.tested + own.prior_weight)

    def choose(
        self,
        candidates: dict[str, int],
        num_decodes: int,
        catch_up: dict[str, float] | None = None,
        flat_draft_seconds: float | None = None,
        lags: dict[str, int] | None = None,
        early: set[str] | frozenset[str] = frozenset(),
    ) -> dict[str, int]:
        """k per candidate request (at most candidates[req_id]); 0 means it does not speculate this step.

        num_decodes: sequences decoding this step (candidates included). Rates are those of the decode part of
        the step, target_cost(num_decodes + verify tokens): prefill chunks sharing the step cost the same
        whatever is chosen. Counted in, a step carrying a long prefill chunk makes verify tokens look nearly
        free next to the emitted tokens, and a batch's decoding sequences draft deep while the rest prefill;
        catch_up: req_id -> draft tokens to charge before it can draft for it (1 when up to date; the
        caller may amortise a long catch-up over the request's remaining steps).

        Greedy by draft position: position j is given to the m requests most likely to accept it, with m
        (0 included) chosen to maximise expected tokens / expected seconds; position j + 1 is considered
        only for requests that got j. A draft position costs one verify token in the target and, for a
        draft model, a share of one more draft forward.

        flat_draft_seconds: a single candidate's drafts, any k of them, cost this much (the draft's compiled
        rollout, serving.engine.spec.rollout): its k is then also weighed as a whole, every position costing
        only its verify token after that one fixed cost, and the better of the two choices is taken. Position
        by position, the first positions would have to pay the fixed cost alone and none would look worth it.

        lags: req_id -> draft tokens the proposer is behind (default: catch_up). An exploration probe is forced
        only where the lag itself is small, whatever share of it catch_up charges.

        early: candidates with fewer than EARLY_OUTPUTS output tokens, whose drafts are weighed at early_rate().
        """
        if not candidates:
            return {}
        if not self.adaptive:
            return {r: min(self.max_k, cap) for r, cap in candidates.items()}
        shared = self.global_rate()
        alphas = {r: self.acceptance(r, shared, r in early) for r in candidates}
        order = sorted(candidates, key=lambda r: -alphas[r])
        ks = dict.fromkeys(candidates, 0)
        tokens = float(num_decodes)  # expected tokens emitted this step
        batch = num_decodes  # decode and verify tokens in the target forward
        draft_seconds = 0.0
        for position in range(1, self.max_k + 1):
            eligible = [r for r in order if ks[r] == position - 1 and candidates[r] >= position]
            base_rate = tokens / (self.target_cost(batch) + draft_seconds)
            best_m, best_rate = 0, base_rate
            gain, fed = 0.0, 0.0
            for m, r in enumerate(eligible, 1):
                gain += alphas[r] ** position  # P(this position is reached and accepted)
                fed += (catch_up or {}).get(r, 1.0) if position == 1 else 1.0
                seconds = self.target_cost(batch + m) + draft_seconds
                if position == 1:
                    seconds += self.sequence_cost.slope * m
                if self.uses_draft_model:
                    seconds += self.draft_cost(fed)
                rate = (tokens + gain) / seconds
                if rate > best_rate:
                    best_m, best_rate = m, rate
            if best_m == 0 or best_rate < base_rate * 1.005:  # a vanishing gain is not worth the variance
                break
            chosen = eligible[:best_m]
            for r in chosen:
                ks[r] = position
            tokens += sum(alphas[r] ** position for r in chosen)
            batch += best_m
            if position == 1:
                draft_seconds += self.sequence_cost.slope * best_m
            if self.uses_draft_model:
                fed = sum((catch_up or {}).get(r, 1.0) for r in chosen) if position == 1 else float(best_m)
                draft_seconds += self.draft_cost(fed)
        rate = tokens / (self.target_cost(batch) + draft_seconds)
        if flat_draft_seconds is not None and len(candidates) == 1:
            ks = self._best_whole_k(ks, candidates, alphas, num_decodes, float(num_decodes), rate, flat_draft_seconds)
        elif len(candidates) > 1 and self.uses_draft_model:
            floor = num_decodes / self.target_cost(num_decodes) * 1.005
            ks = self._best_shared_k(ks, candidates, alphas, order, num_decodes, catch_up or {}, max(rate, floor))
        return self._explore(ks, lags if lags is not None else catch_up or {}, order)

    def _best_shared_k(self, ks: dict[str, int], candidates: dict[str, int], alphas: dict[str, float],
                       order: list[str], num_decodes: int, catch_up: dict[str, float], rate: float) -> dict[str, int]:
        """The best plan in which the m likeliest candidates all draft k (m and k searched), kept only if it beats
        `rate`; for draft models (an n-gram lookup has no forward to share). Position by position, each position
        must pay for itself: a draft forward's fixed cost and each sequence's own overhead fall on the first
        positions, whose gain alone does not cover them, while deep positions of likely requests would (draft
        acceptance rises with depth). At a few dozen sequences the position-by-position choice alone stops after
        a position or two, where every sequence drafting a shared deeper k pays for the forwards; this plan lets
        that choice win where it does (the runs: docs/benchmarks/log.md)."""
        # plans as a [k, m] grid: row k - 1 has every candidate drafting min(k, its cap), summed over the first m
        alpha = np.array([alphas[r] for r in order])
        caps = np.array([candidates[r] for r in order])
        k_grid = np.minimum(np.arange(1, self.max_k + 1)[:, None], caps[None, :])  # [K, M]
        a = np.minimum(alpha, 1.0 - 1e-9)[None, :]
        gain = np.cumsum(a * (1.0 - a**k_grid) / (1.0 - a), axis=1)  # expected accepted drafts
        verify = np.cumsum(k_grid, axis=1)
        m = np.arange(1, len(order) + 1)[None, :]
        target, draft = self.target_cost, self.draft_cost
        seconds = target.intercept + target.slope * (num_decodes + verify) + self.sequence_cost.slope * m
        fed = np.cumsum([catch_up.get(r, 1.0) for r in order])[None, :]
        later_forwards = np.arange(self.max_k)[:, None]  # k - 1 forwards of m tokens after the catch-up's
        per_forward = draft.intercept + draft.slope * m
        seconds = seconds + draft.intercept + draft.slope * fed + later_forwards * per_forward
        plan_rate = (num_decodes + gain) / seconds
        k_best, m_best = np.unravel_index(int(np.argmax(plan_rate)), plan_rate.shape)
        if plan_rate[k_best, m_best] <= rate:
            return ks
        chosen = set(order[: m_best + 1])
        return {r: min(int(k_best) + 1, cap) if r in chosen else 0 for r, cap in candidates.items()}

    def _best_whole_k(self, ks: dict[str, int], candidates: dict[str, int], alphas: dict[str, float], batch: int,
                      tokens: float, rate: float, flat_seconds: float) -> dict[str, int]:
        """The single candidate's k that maximises expected tokens / seconds when its drafts cost flat_seconds
        together; kept only if it beats `rate`, the position-by-position choice's."""
        ((r, cap),) = candidates.items()
        best_k, best_rate, gain = ks[r], rate, 0.0
        for k in range(1, min(self.max_k, cap) + 1):
            gain += alphas[r] ** k
            k_rate = (tokens + gain) / (self.target_cost(batch + k) + flat_seconds + self.sequence_cost.slope)
            if k_rate > best_rate:
                best_k, best_rate = k, k_rate
        return {r: best_k}

    def describe(self, candidates: dict[str, int], num_decodes: int, catch_up: Mapping[str, float],
                 early: set[str] | frozenset[str], ks: Mapping[str, int]) -> dict[str, object]:
        """What one choice saw and chose, for a trace (`bench spec --trace-policy`): the fitted costs, the
        acceptance estimates (each candidate's as min / median / max), the catch-up charged, and the k chosen."""
        shared = self.global_rate()
        alphas = sorted(self.acceptance(r, shared, r in early) for r in candidates)
        charged = sorted(catch_up.get(r, 1.0) for r in candidates)
        histogram: dict[int, int] = {}
        for r in candidates:
            histogram[ks.get(r, 0)] = histogram.get(ks.get(r, 0), 0) + 1

        def spread(values: list[float]) -> list[float]:
            return [round(values[0], 4), round(values[len(values) // 2], 4), round(values[-1], 4)] if values else []

        return {
            "candidates": len(candidates), "decoding": num_decodes, "early": len(early),
            "target_cost_ms": [round(self.target_cost.intercept * 1e3, 4), round(self.target_cost.slope * 1e3, 4)],
            "draft_cost_ms": [round(self.draft_cost.intercept * 1e3, 4), round(self.draft_cost.slope * 1e3, 4)],
            "sequence_cost_us": round(self.sequence_cost.slope * 1e6, 2),
            "global_rate": round(shared, 4), "early_rate": round(self.early_rate(shared), 4),
            "long_run_rate": round(self.long_run_acceptance.rate, 4),
            "alpha": spread(alphas), "catch_up": spread(charged), "k": dict(sorted(histogram.items())),
        }

    def rested(self, req_id: str) -> bool:
        """Whether the request has sat out explore_after steps in a row: the speculator then charges its draft's
        catch-up amortized again, so a request set to k = 0 can resume (at most once per explore_after steps,
        which bounds the churn of catch-ups) instead of waiting for a probe its growing lag never allows."""
        return self._idle_steps.get(req_id, 0) >= self.explore_after

    def _explore(self, ks: dict[str, int], behind: Mapping[str, float], order: list[str]) -> dict[str, int]:
        """Estimates only move when a request speculates; a cheap probe now and then keeps k = 0 from being
        forever (not where the draft would first have to catch up on a long stretch). Two clocks: each
        request's own, and one for the whole engine, so that after overload a stream of short requests
        (each gone before its own probe) still re-probes; meanwhile the global acceptance relaxes toward
        its anchor (global_rate), so speculation comes back within a few dozen steps of load dropping."""
        for r, k in ks.items():
            idle = 0 if k > 0 else self._idle_steps.get(r, 0) + 1
            if idle >= self.explore_after and behind.get(r, 1.0) <= 8.0:
                ks[r], idle = 1, 0
            self._idle_steps[r] = idle
        if any(ks.values()):
            self._steps_without_drafts = 0
            return ks
        self._steps_without_drafts += 1
        self.global_acceptance.relax()
        if self._steps_without_drafts >= self.explore_after:
            probe = next((r for r in order if behind.get(r, 1.0) <= 8.0), None)
            if probe is not None:
                ks[probe] = 1
                self._steps_without_drafts = 0
                self._idle_steps[probe] = 0
        return ks

    def observe_target_step(self, num_tokens: int, seconds: float) -> None:
        self.target_cost.observe(num_tokens, seconds)

    def observe_draft_forward(self, num_tokens: int, seconds: float) -> None:
        self.draft_cost.observe(num_tokens, seconds)

    def observe_speculator_work(self, num_speculating: int, seconds: float) -> None:
        self.sequence_cost.observe(num_speculating, seconds)

    def observe_verification(self, req_id: str, accepted: int, drafted: int, early: bool = False) -> None:
        """A step in which one sequence verified its drafts."""
        self.observe_verifications([(req_id, accepted, drafted, early)])

    def observe_verifications(self, verifications: list[tuple[str, int, int, bool]]) -> None:
        """One step's verifications, (req_id, accepted, drafted, early) each; early: drafted before the request had
        EARLY_OUTPUTS output tokens.

        Early drafts are their own population. The first tokens after a prompt are the hardest to guess: a draft
        agrees with the target far less often at output positions 0 and 1 than from position 2 on. A batch that
        starts together verifies its first drafts in one step; counted with the rest, they pull the global
        estimate down until every request looks too poor to draft and the batch runs to its end at k = 0, and
        they hold each request's own history down for the whole request. So they are tracked apart (early_rate),
        and leave the global, long-run and per-request estimates alone.

        The recent global estimate fades once per step, not once per verification: faded per verification, one
        step of 57 sequences weighed everything before it by 0.95^57 = 0.05. The long-run anchor counts
        verifications, ~1,000 of them."""
        steady = [(a, d) for _, a, d, early in verifications if not early]
        if steady:
            self.global_acceptance.observe_step(steady)
        for req_id, accepted, drafted, early in verifications:
            if early:
                self.early_acceptance.observe(accepted, drafted)
                continue
            self.long_run_acceptance.observe(accepted, drafted)
            # a request's own estimate leans on the global rate until it has tested about a full verification's
            # worth of positions: weighed against 2 positions of prior, one verification rejected at once put the
            # request at 0.62, below every plan, so it never drafted again
            own = self.per_request.setdefault(req_id, Acceptance(prior=0.0, prior_weight=float(self.max_k)))
            own.observe(accepted, drafted)

    def forget(self, req_id: str) -> None:
        self.per_request.pop(req_id, None)
        self._idle_steps.pop(req_id, None)
