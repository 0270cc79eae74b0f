"""How many draft tokens each sequence verifies this step: chosen for goodput, 0 included.

Costs are measured, not assumed: the target's step time is fitted online as a + b * tokens (a: per-step
overhead, b: per-token work), the draft's as c + d * tokens per draft forward. Acceptance is tracked
per request and globally (exponentially decayed). With per-token acceptance alpha, k drafts yield
(1 - alpha^(k+1)) / (1 - alpha) tokens in expectation. For each candidate k the policy estimates

    goodput(k) = expected tokens of all sequences / (target step time + k draft forwards)

and takes the best. At low load the step is overhead-bound (a dominates), verifying k extra tokens is
nearly free and speculation wins; as the batch fills, b * tokens dominates, extra verify tokens cost
as much as they earn and k falls to 0, so speculation never costs throughput.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LinearCost:
    """Online least squares fit of seconds = intercept + slope * x with exponential forgetting."""

    intercept: float
    slope: float
    decay: float = 0.98
    _n: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0

    def observe(self, x: float, seconds: float) -> None:
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
        tested = accepted + (1 if accepted < drafted else 0)  # positions after the first rejection were not tested
        self.accepted = self.decay * self.accepted + accepted
        self.tested = self.decay * self.tested + tested

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


@dataclass
class SpeculationPolicy:
    max_k: int
    adaptive: bool = True
    uses_draft_model: bool = True
    target_cost: LinearCost = field(default_factory=lambda: LinearCost(intercept=5e-3, slope=1e-4))
    draft_cost: LinearCost = field(default_factory=lambda: LinearCost(intercept=1e-3, slope=2e-5))
    global_acceptance: Acceptance = field(default_factory=Acceptance)
    per_request: dict[str, Acceptance] = field(default_factory=dict)
    explore_after: int = 32  # a request left at k = 0 this many steps gets one k = 1 probe
    _idle_steps: dict[str, int] = field(default_factory=dict)
    _steps_without_drafts: int = 0  # across all requests: short requests never reach their own probe

    def acceptance(self, req_id: str) -> float:
        own = self.per_request.get(req_id)
        if own is None:
            return self.global_acceptance.rate
        # a request's own history, with the global rate as its prior
        return (own.accepted + self.global_acceptance.rate * own.prior_weight) / (own.tested + own.prior_weight)

    def choose(
        self,
        candidates: dict[str, int],
        other_tokens: int,
        num_decodes: int,
        catch_up: dict[str, float] | None = None,
        flat_draft_seconds: float | None = None,
    ) -> dict[str, int]:
        """k per candidate request (at most candidates[req_id]); 0 means it does not speculate this step.

        other_tokens: tokens of the step that are not decode/verify tokens (prefill chunks);
        num_decodes: sequences decoding this step (candidates included);
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
        """
        if not candidates:
            return {}
        if not self.adaptive:
            return {r: min(self.max_k, cap) for r, cap in candidates.items()}
        alphas = {r: self.acceptance(r) for r in candidates}
        order = sorted(candidates, key=lambda r: -alphas[r])
        ks = dict.fromkeys(candidates, 0)
        tokens = float(num_decodes)  # expected tokens emitted this step
        batch = other_tokens + num_decodes  # tokens in the target forward
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
            if self.uses_draft_model:
                fed = sum((catch_up or {}).get(r, 1.0) for r in chosen) if position == 1 else float(best_m)
                draft_seconds += self.draft_cost(fed)
        if flat_draft_seconds is not None and len(candidates) == 1:
            ks = self._best_whole_k(ks, candidates, alphas, other_tokens + num_decodes, float(num_decodes),
                                    tokens / (self.target_cost(batch) + draft_seconds), flat_draft_seconds)
        return self._explore(ks, catch_up or {}, order)

    def _best_whole_k(self, ks: dict[str, int], candidates: dict[str, int], alphas: dict[str, float], batch: int,
                      tokens: float, rate: float, flat_seconds: float) -> dict[str, int]:
        """The single candidate's k that maximises expected tokens / seconds when its drafts cost flat_seconds
        together; kept only if it beats `rate`, the position-by-position choice's."""
        ((r, cap),) = candidates.items()
        best_k, best_rate, gain = ks[r], rate, 0.0
        for k in range(1, min(self.max_k, cap) + 1):
            gain += alphas[r] ** k
            k_rate = (tokens + gain) / (self.target_cost(batch + k) + flat_seconds)
            if k_rate > best_rate:
                best_k, best_rate = k, k_rate
        return {r: best_k}

    def _explore(self, ks: dict[str, int], catch_up: dict[str, float], order: list[str]) -> dict[str, int]:
        """Estimates only move when a request speculates; a cheap probe now and then keeps k = 0 from being
        forever (not where the draft would first have to catch up on a long stretch). Two clocks: each
        request's own, and one for the whole engine, so that after overload a stream of short requests
        (each gone before its own probe) still re-probes; meanwhile the global acceptance relaxes toward
        its prior, so speculation comes back within a few dozen steps of load dropping."""
        for r, k in ks.items():
            idle = 0 if k > 0 else self._idle_steps.get(r, 0) + 1
            if idle >= self.explore_after and catch_up.get(r, 1.0) <= 8.0:
                ks[r], idle = 1, 0
            self._idle_steps[r] = idle
        if any(ks.values()):
            self._steps_without_drafts = 0
            return ks
        self._steps_without_drafts += 1
        self.global_acceptance.relax()
        if self._steps_without_drafts >= self.explore_after:
            probe = next((r for r in order if catch_up.get(r, 1.0) <= 8.0), None)
            if probe is not None:
                ks[probe] = 1
                self._steps_without_drafts = 0
                self._idle_steps[probe] = 0
        return ks

    def observe_target_step(self, num_tokens: int, seconds: float) -> None:
        self.target_cost.observe(num_tokens, seconds)

    def observe_draft_forward(self, num_tokens: int, seconds: float) -> None:
        self.draft_cost.observe(num_tokens, seconds)

    def observe_verification(self, req_id: str, accepted: int, drafted: int) -> None:
        self.global_acceptance.observe(accepted, drafted)
        self.per_request.setdefault(req_id, Acceptance(prior=0.0, prior_weight=2.0)).observe(accepted, drafted)

    def forget(self, req_id: str) -> None:
        self.per_request.pop(req_id, None)
        self._idle_steps.pop(req_id, None)
