"""A seeded sampled request gives the same text whatever k the adaptive policy picks for it, whatever shares its
batch, and with speculation off (issue 37): its draws are a function of (seed, output position) alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from serving.engine.config import SpeculativeConfig
from serving.engine.engine import LLMEngine
from serving.engine.types import GenerationRequest, SamplingParams

SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=40, ignore_eos=True)
OTHERS = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def weak_draft_dir(kit: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another, smaller random model: most of its drafts are rejected."""
    return kit.save_tiny_model(tmp_path_factory.mktemp("weak-draft"), "llama", num_hidden_layers=1, hidden_size=32,
                               intermediate_size=48)


def run(engine: LLMEngine, prompt: list[int], others: list[list[int]], start_after: int = 0) -> tuple[list[int],
                                                                                                     list[int]]:
    """The seeded request's tokens and the k it was given each step; others run beside it, and it is added only
    after start_after steps of theirs."""
    chosen: list[int] = []
    assert engine.speculator is not None
    choose = engine.speculator.policy.choose

    def recording(*args: Any, **kwargs: Any) -> dict[str, int]:
        ks = choose(*args, **kwargs)
        if "seeded" in ks:
            chosen.append(ks["seeded"])
        return ks

    engine.speculator.policy.choose = recording  # type: ignore[method-assign]
    for i, other in enumerate(others):
        engine.add_request(GenerationRequest(f"other-{i}", other, OTHERS))
    got: list[int] = []
    steps = 0
    while engine.has_unfinished_requests() or steps <= start_after:
        if steps == start_after:
            engine.add_request(GenerationRequest("seeded", prompt, SEEDED))
        for out in engine.step():
            if out.request_id == "seeded":
                got += out.new_token_ids
        steps += 1
    engine.speculator.policy.choose = choose  # type: ignore[method-assign]
    return got, chosen


@pytest.mark.parametrize("draft", ["target", "weak"])
def test_a_seeded_request_gives_the_same_text_alone_in_a_batch_after_a_burst_and_without_speculation(
    kit: Any, llama_dir: Path, weak_draft_dir: Path, draft: str
) -> None:
    prompt = kit.random_prompts([14], seed=3)[0]
    spec = SpeculativeConfig(enabled=True, method="draft", adaptive=True, num_draft_tokens=4,
                             draft_model=str(llama_dir if draft == "target" else weak_draft_dir))
    engine = kit.make_engine(llama_dir, speculative=spec, max_concurrency=64, max_batched_tokens=512,
                             kv_cache_bytes=16 * 2**20)
    alone, k_alone = run(engine, prompt, [])
    beside, k_beside = run(engine, prompt, kit.random_prompts([5, 30, 17, 9, 22, 11], seed=9))
    burst, k_burst = run(engine, prompt, kit.random_prompts([8 + i % 13 for i in range(40)], seed=10), start_after=3)
    off = kit.run_to_completion(kit.make_engine(llama_dir), [prompt], [SEEDED])[0]

    assert len(alone) == SEEDED.max_tokens
    assert alone == beside == burst == off
    # the policy really gave it different k: the draws are not tied to how many drafts a step verified
    assert len({tuple(k_alone), tuple(k_beside), tuple(k_burst)}) > 1, (k_alone, k_beside, k_burst)
    assert engine.stats().spec.num_draft_tokens > 0
