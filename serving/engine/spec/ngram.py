"""N-gram prompt lookup: propose what followed the latest earlier occurrence of the sequence's suffix.

Code and extraction outputs repeat their inputs; a match of the last n tokens elsewhere in the prompt
or output predicts the next tokens for free (no model runs). Longest n first.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from serving.engine.request import Request
from serving.engine.spec.proposer import Proposals


class NgramProposer:
    uses_model = False  # a lookup in the sequence's own tokens: drafting is free

    def __init__(self, n_min: int = 1, n_max: int = 4) -> None:
        self.n_min, self.n_max = n_min, n_max

    def propose_one(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier match of the last n tokens."""
        if k <= 0 or len(token_ids) < self.n_min + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            suffix = tokens[-n:]
            windows = sliding_window_view(tokens[:-1], n)  # every earlier n-gram (not the suffix itself)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
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
        return None  # drafting is free: there is no draft forward to price

    def release(self, req_id: str) -> None:
        pass
