"""The speculator drives any proposer through the `Proposer` protocol, never by its concrete type."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest

from serving.engine.config import SpeculativeConfig
from serving.engine.engine import LLMEngine
from serving.engine.request import Request
from serving.engine.spec import speculator as speculator_module
from serving.engine.spec.draft import DraftModelProposer
from serving.engine.spec.ngram import NgramProposer
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
    engine.speculator = Speculator(engine.config.speculative, oracle, engine.config.max_num_batched_tokens,
                                   engine.max_model_len)
    assert kit.run_to_completion(engine, prompts, params) == expected

    spec = engine.stats().spec
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens  # the oracle is right
    assert engine.speculator.policy.uses_draft_model is uses_model
    assert all(0 < k <= K for asked in oracle.proposed for k in asked.values())
    assert oracle.rollbacks  # verified sequences were rolled back to what the target kept...
    assert sorted(oracle.released) == ["0", "1", "2"]  # ...and every finished request was released
