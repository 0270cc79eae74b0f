"""The demo target (8 heads over 4 KV heads) served by 2 gloo ranks with its draft model speculating on rank 0:
greedy outputs identical to one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serving.engine.config import SpeculativeConfig
from serving.engine.engine import LLMEngine
from serving.engine.types import SamplingParams

pytestmark = pytest.mark.slow

DEMO = Path(__file__).resolve().parents[4] / "serving" / "demo"
TARGET, DRAFT = DEMO / "models" / "target", DEMO / "models" / "draft"
MAX_TOKENS = 24


def demo_prompts(n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TARGET))
    lines = (DEMO / "prompts" / "code.jsonl").read_text().splitlines()[:n]
    return [tokenizer.encode(json.loads(line)["prompt"])[-200:] for line in lines]


def greedy(kit, engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)] * len(prompts)
    return kit.run_to_completion(engine, prompts, params)


def test_greedy_outputs_match_one_process_with_speculative_decoding(kit) -> None:
    prompts = demo_prompts(4)
    spec = SpeculativeConfig(enabled=True, method="draft", draft_model=str(DRAFT), num_draft_tokens=3,
                             adaptive=False)
    settings = dict(speculative=spec, max_batched_tokens=256, num_threads=1)
    single = kit.make_engine(TARGET, **settings)
    expected = greedy(kit, single, prompts)
    assert single.stats().spec.num_draft_tokens > 0  # the drafts were verified, not skipped
    engine = kit.make_engine(TARGET, tensor_parallel_size=2, **settings)
    try:
        got = greedy(kit, engine, prompts)
        accepted = engine.stats().spec.num_accepted_tokens
    finally:
        engine.close()
    assert got == expected
    assert accepted == single.stats().spec.num_accepted_tokens

