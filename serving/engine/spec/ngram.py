"""N-gram prompt lookup: propose what followed the latest earlier occurrence of the sequence's suffix.

Code and extraction outputs repeat their inputs; a match of the last n tokens elsewhere in the prompt
or output predicts the next tokens for free (no model runs). Longest n first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from serving.engine.request import Request
from serving.engine.spec.proposer import Proposals

if TYPE_CHECKING:
    from serving.config import DecodeAttentionMode, WeightPacking
    from serving.engine.kernels.cpu_attention import AttentionDecision
    from serving.engine.kernels.cpu_linear import PackingDecision
    from serving.engine.spec.rollout import RolloutDecision


class NgramProposer:
    uses_model = False  # a lookup in the sequence's own tokens: no model forward

    def __init__(self, n_min: int = 1, n_max: int = 4) -> None:
        self.n_min, self.n_max = n_min, n_max

    def propose_one(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier match of the last n tokens (longest n first).

        Every earlier occurrence of the last token is a 1-token match ending there; a longer match is one of
        those whose preceding tokens agree too, so one vector comparison finds the candidates and each longer n
        only filters them: 9 us for a 220-token request, where comparing every window for every n took 40."""
        if k <= 0 or len(token_ids) < self.n_min + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        last = len(tokens) - 1
        ends = np.flatnonzero(tokens[:last] == tokens[last])  # earlier positions holding the last token
        if ends.size == 0:
            return []
        for n in range(min(self.n_max, last), self.n_min - 1, -1):
            match = ends[ends >= n - 1]
            for back in range(1, n):
                match = match[tokens[match - back] == tokens[last - back]]
            if match.size:
                start = int(match[-1]) + 1
                return tokens[start : start + k].tolist()
        return []

    def propose(self, reqs: list[Request], ks: dict[str, int]) -> Proposals:
        """Drafts for every request with a match (absent when none)."""
        proposals = Proposals()
        for req in reqs:
            drafts = self.propose_one(req.all_token_ids, ks.get(req.request_id, 0))
            if drafts:
                proposals.tokens[req.request_id] = drafts
        return proposals

    def lag(self, req: Request) -> int:
        return 1  # no state of its own: always up to date

    def rollback(self, req_id: str, num_valid_tokens: int) -> None:
        pass  # nothing cached past the sequence's tokens

    def fixed_draft_seconds(self, req: Request) -> float | None:
        return None  # there is no draft forward to price

    def release(self, req_id: str) -> None:
        pass

    # start-up: no model, so nothing to attend with, roll out, pack or compile, and nothing decided

    def set_paged_attention(self, on: bool) -> None:
        pass

    def prepare_rollout(self, mode: str, num_draft_tokens: int, wrapper: str) -> RolloutDecision | None:
        return None

    def pack_weights(self, mode: WeightPacking, reason_not: str | None) -> list[PackingDecision]:
        return []

    def choose_attention(self, mode: DecodeAttentionMode, tensor_parallel: bool) -> list[AttentionDecision]:
        return []

    def compile_steps(self, max_rows: int, measure: bool, whole_decode: bool | None, backend: str) -> None:
        pass

    def decisions(self) -> list[tuple[str, str, str]]:
        return []
