"""The draft model's own cache reuses cached prefix blocks the way the target's does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from serving.engine.config import SpeculativeConfig
from serving.engine.engine import LLMEngine
from serving.engine.spec.draft import DraftModelProposer
from serving.engine.types import GenerationRequest, SamplingParams


def draft_engine(kit: Any, model_dir: Path, draft_prefix_caching: bool = True, **overrides: object) -> LLMEngine:
    # the draft is the target itself: drafts are mostly accepted, so rollbacks end inside and at block edges
    spec = SpeculativeConfig(enabled=True, method="draft", draft_model=str(model_dir), num_draft_tokens=3,
                             adaptive=False)
    engine = kit.make_engine(model_dir, speculative=spec, **overrides)
    draft(engine).blocks.enable_prefix_caching = draft_prefix_caching
    return engine


def draft(engine: LLMEngine) -> DraftModelProposer:
    assert engine.speculator is not None and isinstance(engine.speculator.proposer, DraftModelProposer)
    return engine.speculator.proposer


def shared_prompts(kit: Any, n: int) -> list[list[int]]:
    system = kit.random_prompts([53], seed=11)[0]  # three full blocks of 16 and a partial one
    return [system + tail for tail in kit.random_prompts([4 + 5 * i for i in range(n)], seed=12)]


def run_one_by_one(kit: Any, engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [kit.run_to_completion(engine, [p], [params])[0] for p in prompts]


def assert_draft_blocks_released(engine: LLMEngine) -> None:
    proposer = draft(engine)
    assert proposer.blocks.num_used == 0 and not proposer.computed
    assert all(proposer.blocks.ref_count(b) == 0 for b in range(proposer.blocks.num_blocks))


def test_later_requests_reuse_the_drafts_cached_prefix_and_outputs_stay_identical(kit: Any, llama_dir: Path) -> None:
    prompts = shared_prompts(kit, 4)
    expected = run_one_by_one(kit, kit.make_engine(llama_dir), prompts)
    cold = draft_engine(kit, llama_dir, draft_prefix_caching=False)
    warm = draft_engine(kit, llama_dir)
    assert run_one_by_one(kit, cold, prompts) == expected
    assert run_one_by_one(kit, warm, prompts) == expected
    assert draft(cold).prefix_hit_tokens_total == 0
    # requests 2..4 find the 48 system-prompt tokens of the first in the draft cache
    assert draft(warm).prefix_hit_tokens_total == 3 * 48
    assert draft(warm).catch_up_tokens_total == draft(cold).catch_up_tokens_total - 3 * 48
    assert warm.stats().spec.num_accepted_tokens > 0
    assert_draft_blocks_released(warm)
    assert draft(warm).blocks.num_cached > 0  # kept for the next request, evictable


def test_aborts_and_preemption_leave_the_draft_cache_clean(kit: Any, llama_dir: Path) -> None:
    prompts = shared_prompts(kit, 10)
    expected = run_one_by_one(kit, kit.make_engine(llama_dir), prompts[:3], max_tokens=20)
    # a budget far too small for ten requests at once: the scheduler preempts, and the draft loses them too
    engine = draft_engine(kit, llama_dir, kv_cache_bytes=14 * block_bytes(kit, llama_dir), max_batched_tokens=48)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(GenerationRequest(str(i), p, params))
    got: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
        if step % 9 == 4 and len(engine.scheduler.running) > 1:
            engine.abort_request(engine.scheduler.running[-1].request_id)
    assert engine.stats().preemptions_total > 0
    assert draft(engine).prefix_hit_tokens_total > 0
    finished = [i for i in range(3) if len(got.get(str(i), [])) == 20]
    assert finished and all(got[str(i)] == expected[i] for i in finished)
    assert_draft_blocks_released(engine)


def block_bytes(kit: Any, model_dir: Path) -> int:
    cache = kit.make_engine(model_dir).runner.cache
    return cache.k[:, 0].numel() * 2 * cache.k.element_size()
