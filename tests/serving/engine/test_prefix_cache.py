"""Automatic prefix caching: content-addressed, reference-counted KV blocks reused across requests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from serving.engine.config import SpeculativeConfig
from serving.engine.engine import LLMEngine
from serving.engine.kv_cache import BlockManager
from serving.engine.types import GenerationRequest, SamplingParams

# ---- the block manager ----------------------------------------------------------------------------------


def computed(blocks: BlockManager, seq: str, tokens: list[int]) -> None:
    """Run a sequence as the scheduler would: match, allocate the rest, mark everything computed."""
    cached = blocks.match_prefix(seq, tokens)
    assert blocks.allocate(seq, len(tokens))
    assert cached < len(tokens)
    blocks.commit(seq, tokens, len(tokens))


def test_a_later_sequence_shares_the_full_blocks_of_an_earlier_one() -> None:
    blocks = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prefix = list(range(100, 112))  # three full blocks
    computed(blocks, "a", prefix + [1, 2, 3])
    assert blocks.match_prefix("b", prefix + [7, 8]) == 12
    shared = blocks.block_table("b")
    assert shared == blocks.block_table("a")[:3]
    assert all(blocks.ref_count(b) == 2 for b in shared)
    assert blocks.block_table("a")[3] not in shared  # the partial tail stays private


def test_at_least_one_token_is_left_to_compute() -> None:
    blocks = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    tokens = list(range(8))
    computed(blocks, "a", tokens + [99])
    # an identical 8-token prompt: both blocks cached, but its last token must run to give logits
    assert blocks.match_prefix("b", tokens) == 4


def test_only_blocks_full_of_computed_tokens_are_cached() -> None:
    blocks = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    tokens = list(range(1, 9))
    assert blocks.allocate("a", 8)
    blocks.commit("a", tokens, 7)  # the 8th token was just sampled: no K/V for it yet
    assert blocks.num_cached == 1
    assert blocks.match_prefix("b", tokens + [0]) == 4
    blocks.commit("a", tokens, 8)
    assert blocks.num_cached == 2


def test_a_block_matches_only_after_the_same_prefix() -> None:
    blocks = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    computed(blocks, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    # the second block's tokens are the same, the first block's are not: no hit at all
    assert blocks.match_prefix("b", [9, 9, 9, 9, 5, 6, 7, 8, 0]) == 0
    assert blocks.block_table("b") == []


def test_finished_blocks_stay_cached_and_are_evicted_lru_only_under_pressure() -> None:
    blocks = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    computed(blocks, "old", [1] * 8 + [0])  # 3 blocks, 2 of them full
    computed(blocks, "new", [2] * 8 + [0])
    blocks.free("old")
    blocks.free("new")
    assert blocks.num_used == 0 and blocks.num_free == 6 and blocks.num_cached == 4
    # 2 never-cached blocks are handed out before any cached one is evicted
    assert blocks.allocate("x", 8)
    assert blocks.num_cached == 4
    # one more block evicts the least recently freed: "old"'s tail first, its head survives
    assert blocks.allocate("x", 12)
    assert blocks.num_cached == 3
    assert blocks.match_prefix("old-again", [1] * 8 + [0]) == 4
    assert blocks.match_prefix("new-again", [2] * 8 + [0]) == 8


def test_duplicate_content_stays_private_and_truncate_never_drops_a_shared_block() -> None:
    blocks = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    tokens = [5] * 8 + [1]
    # two sequences computed the same prefix at once: only the first's blocks become the cached copy
    assert blocks.allocate("a", 9) and blocks.allocate("b", 9)
    blocks.commit("a", tokens, 9)
    blocks.commit("b", tokens, 9)
    assert blocks.num_cached == 2
    blocks.free("b")
    assert blocks.num_cached == 2 and blocks.num_free == 16 - 3
    assert blocks.match_prefix("c", tokens) == 8
    assert blocks.allocate("c", 12)
    blocks.truncate("c", 8)  # a rollback to the end of the shared blocks keeps them
    assert blocks.block_table("c") == blocks.block_table("a")[:2]
    assert [blocks.ref_count(b) for b in blocks.block_table("a")] == [2, 2, 1]


def test_without_prefix_caching_nothing_is_matched_or_kept() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4)
    computed(blocks, "a", list(range(9)))
    blocks.free("a")
    assert blocks.num_cached == 0 and blocks.match_prefix("b", list(range(9))) == 0


# ---- the engine ------------------------------------------------------------------------------------------

SYSTEM = list(range(3, 3 + 40))  # a 40-token "system prompt": 2 full blocks of 16 and a partial one


def shared_prefix_prompts(kit: Any, n: int, seed: int = 5) -> list[list[int]]:
    tails = kit.random_prompts([3 + (7 * i) % 19 for i in range(n)], seed=seed)
    return [SYSTEM + tail for tail in tails]


def block_bytes(engine: LLMEngine) -> int:
    return engine.runner.cache.k[:, 0].numel() * 2 * engine.runner.cache.k.element_size()


def assert_all_released(engine: LLMEngine) -> None:
    blocks = engine.blocks
    assert blocks.num_used == 0 and blocks.num_free == blocks.num_blocks
    assert all(blocks.ref_count(b) == 0 for b in range(blocks.num_blocks))


def greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_in_waves(kit: Any, engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams],
                 wave: int = 4) -> list[list[int]]:
    """Later requests arrive after earlier ones finished, so they find the shared prefix cached."""
    out: list[list[int]] = []
    for i in range(0, len(prompts), wave):
        out += kit.run_to_completion(engine, prompts[i : i + wave], params[i : i + wave])
    return out


def test_outputs_are_identical_with_and_without_prefix_caching(kit: Any, llama_dir: Path) -> None:
    prompts = shared_prefix_prompts(kit, 12)
    params = [greedy() for _ in prompts]
    # seeded sampling draws the same numbers whether the prefix was computed or reused
    params[1::3] = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=24, ignore_eos=True)
                    for i in range(4)]
    off = kit.make_engine(llama_dir, enable_prefix_caching=False, max_batched_tokens=32)
    on = kit.make_engine(llama_dir, max_batched_tokens=32)  # chunked prefill: 32 tokens a step
    expected = run_in_waves(kit, off, prompts, params)
    assert run_in_waves(kit, on, prompts, params) == expected

    stats, stats_off = on.stats(), off.stats()
    assert stats_off.prefix_cache_hits_total == 0
    assert stats.prefix_cache_queries_total == sum(len(p) for p in prompts)
    # every request after the first wave reuses at least the 2 full blocks of the system prompt
    assert stats.prefix_cache_hits_total >= 8 * 32
    assert stats.prompt_tokens_total <= stats_off.prompt_tokens_total - stats.prefix_cache_hits_total
    assert_all_released(on)


def test_concurrent_requests_with_the_same_prefix_share_blocks(kit: Any, llama_dir: Path) -> None:
    engine = kit.make_engine(llama_dir)
    prompts = shared_prefix_prompts(kit, 4)
    engine.add_request(GenerationRequest("first", prompts[0], greedy(40)))
    engine.step()  # the first request's prefill puts the system prompt in the cache
    for i, prompt in enumerate(prompts[1:]):
        engine.add_request(GenerationRequest(f"r{i}", prompt, greedy(40)))
    engine.step()
    tables = [engine.blocks.block_table(r.request_id) for r in engine.scheduler.running]
    assert len(tables) == 4
    shared = tables[0][:2]
    assert all(t[:2] == shared for t in tables)
    assert [engine.blocks.ref_count(b) for b in shared] == [4, 4]
    assert len({t[2] for t in tables}) == 4  # the partial third block is each request's own
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_released(engine)
    assert engine.blocks.num_cached > 2  # finished requests' blocks stay cached


def test_eviction_under_a_tiny_kv_budget_keeps_every_request_correct(kit: Any, llama_dir: Path) -> None:
    prompts = shared_prefix_prompts(kit, 24, seed=9)
    params = [greedy(30) for _ in prompts]
    expected = kit.run_to_completion(kit.make_engine(llama_dir, enable_prefix_caching=False), prompts, params)
    probe = kit.make_engine(llama_dir)
    tight = kit.make_engine(llama_dir, kv_cache_bytes=20 * block_bytes(probe))  # 20 blocks for 24 requests
    assert tight.blocks.num_blocks == 20
    # checked after every step: blocks are shared only as cached full prefixes, never beyond a request's tokens
    assert kit.run_to_completion(tight, prompts, params, after_step=assert_tables_consistent) == expected
    stats = tight.stats()
    assert stats.preemptions_total > 0 and stats.prefix_cache_hits_total > 0
    assert_all_released(tight)


def assert_tables_consistent(engine: LLMEngine) -> None:
    blocks = engine.blocks
    held: dict[int, int] = {}
    for req in engine.scheduler.running:
        table = blocks.block_table(req.request_id)
        assert len(table) == blocks.blocks_for(req.num_computed_tokens)
        for b in table:
            held[b] = held.get(b, 0) + 1
    assert all(blocks.ref_count(b) == held.get(b, 0) for b in range(blocks.num_blocks))
    for b, count in held.items():  # a block held twice is a cached one: it is never written again
        assert count == 1 or b in blocks._hash_of


def test_aborted_and_preempted_requests_leave_reference_counts_right(kit: Any, llama_dir: Path) -> None:
    probe = kit.make_engine(llama_dir)
    engine = kit.make_engine(llama_dir, kv_cache_bytes=16 * block_bytes(probe), max_batched_tokens=32)
    prompts = shared_prefix_prompts(kit, 10, seed=4)
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(f"r{i}", prompt, greedy(60)))
    aborted = 0
    for step in range(400):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        assert_tables_consistent(engine)
        if step % 7 == 3 and engine.scheduler.running:  # abort mid-prefill and mid-decode alike
            engine.abort_request(engine.scheduler.running[-1].request_id)
            aborted += 1
    assert not engine.has_unfinished_requests()
    assert aborted > 0 and engine.stats().preemptions_total > 0
    assert_all_released(engine)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_with_prefix_caching_is_identical(kit: Any, llama_dir: Path, method: str) -> None:
    # prompts that repeat themselves give the n-gram proposer matches; the draft is the target itself,
    # so drafts are mostly accepted and rollbacks stop inside and at the edge of blocks
    prompts = [p + p for p in shared_prefix_prompts(kit, 8, seed=2)]
    params = [greedy(30) for _ in prompts]
    expected = run_in_waves(kit, kit.make_engine(llama_dir, enable_prefix_caching=False), prompts, params)
    spec = SpeculativeConfig(enabled=True, method=method, num_draft_tokens=4, adaptive=False,
                             draft_model=str(llama_dir) if method == "draft" else None)
    probe = kit.make_engine(llama_dir)
    engine = kit.make_engine(llama_dir, speculative=spec, kv_cache_bytes=24 * block_bytes(probe),
                             max_batched_tokens=48)
    assert run_in_waves(kit, engine, prompts, params) == expected
    stats = engine.stats()
    assert stats.spec.num_accepted_tokens > 0 and stats.prefix_cache_hits_total > 0
    assert_all_released(engine)
