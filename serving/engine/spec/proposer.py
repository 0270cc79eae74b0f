"""What a proposer is: one `propose` signature, implemented by every file next to this one.

The speculator drives any proposer through this interface and never asks which kind it has. The one
difference that matters to it is cost, stated by `uses_model`: a model-free proposer (n-gram lookup)
drafts for free, so it drafts up to each cap and the policy trims; a model-based one (a draft model)
pays a forward per draft position, so the policy picks k first and the proposer drafts exactly that.

The engine's build step (serving.engine.build) prepares any proposer through the start-up hooks at the
end of the protocol, in the order it takes its own decisions: a proposer without a model of its own
decides nothing there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from serving.config import DecodeAttentionMode, WeightPacking
    from serving.engine.kernels.cpu_attention import AttentionDecision
    from serving.engine.kernels.cpu_linear import PackingDecision
    from serving.engine.request import Request
    from serving.engine.spec.rollout import RolloutDecision


@dataclass
class Proposals:
    tokens: dict[str, list[int]] = field(default_factory=dict)  # req_id -> draft tokens (absent: none)
    # req_id -> q [k, vocab] of a model's drafts for a request verified by rejection sampling (unseeded, sampled)
    probs: dict[str, torch.Tensor] = field(default_factory=dict)
    forward_seconds: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds) per draft forward
    rollout_seconds: float = 0.0  # a compiled rollout's time (priced as a whole: Proposer.fixed_draft_seconds)

    @property
    def priced_seconds(self) -> float:
        """The drafting time the policy prices by itself: draft forwards and rollouts."""
        return sum(seconds for _, seconds in self.forward_seconds) + self.rollout_seconds


@runtime_checkable
class Proposer(Protocol):
    # True: each draft position costs a model forward (the policy charges it, and the proposer may lag the
    # sequence and have to catch up); False: no forward (a lookup; the speculator still asks only for the drafts
    # the policy chose)
    uses_model: bool

    def propose(self, reqs: list[Request], ks: dict[str, int]) -> Proposals:
        """Up to ks[req_id] draft tokens following each request's tokens so far."""
        ...

    def lag(self, req: Request) -> int:
        """Tokens the proposer must run for this sequence before it can draft (1 when it is up to date)."""
        ...

    def rollback(self, req_id: str, num_valid_tokens: int) -> None:
        """The sequence keeps only its first num_valid_tokens tokens (the rest were rejected drafts)."""
        ...

    def release(self, req_id: str) -> None:
        """The request left the running set: drop whatever the proposer holds for it."""
        ...

    def fixed_draft_seconds(self, req: Request) -> float | None:
        """Seconds that drafting any k tokens for this sequence alone costs, where that cost does not grow with k
        (a draft model's compiled rollout); None where each draft position costs its own forward."""
        ...

    # ---- start-up: called once each by serving.engine.build, before any request --------------------------

    def set_paged_attention(self, on: bool) -> None:
        """Attend from the paged cache in place, as the target does (CUDA), or gather + SDPA."""
        ...

    def prepare_rollout(self, mode: str, num_draft_tokens: int, wrapper: str) -> RolloutDecision | None:
        """speculative.draft_rollout: draft through one compiled graph or not, and why (None: nothing to roll out)."""
        ...

    def pack_weights(self, mode: WeightPacking, reason_not: str | None) -> list[PackingDecision]:
        """model.cpu_weight_packing for the proposer's models; reason_not: why packing cannot apply to the engine."""
        ...

    def choose_attention(self, mode: DecodeAttentionMode, tensor_parallel: bool) -> list[AttentionDecision]:
        """model.cpu_decode_attention for the proposer's models."""
        ...

    def compile_steps(self, max_rows: int, measure: bool, whole_decode: bool | None, backend: str) -> None:
        """Compile the proposer's forwards of up to max_rows tokens, as the target's are (model.compile)."""
        ...

    def decisions(self) -> list[tuple[str, str, str]]:
        """What the proposer decided at start-up, as (setting, what was chosen, why) rows of the start-up line."""
        ...
