from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from serving.engine.types import GenerationRequest, RequestRejected, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=72, ignore_eos=True)


def hf_greedy(model_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        out = ref.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        outs.append(out[0, len(p) :].tolist())
    return outs


@pytest.fixture(scope="module")
def llama_reference(kit: Any, llama_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts = kit.random_prompts([37, 5, 20, 60, 3, 11])
    return prompts, hf_greedy(llama_dir, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("packing", ["off", "on"])  # plain nn.Linear, and weights packed for oneDNN
def test_greedy_matches_transformers_generate_for_72_tokens(kit: Any, llama_dir: Path, llama_reference,
                                                           packing: str) -> None:
    prompts, expected = llama_reference
    # a small token budget forces chunked prefill next to decodes
    engine = kit.make_engine(llama_dir, max_batched_tokens=32, cpu_weight_packing=packing)
    assert [d.packed for d in engine.runner.weight_packing] == [packing == "on"]
    assert kit.run_to_completion(engine, prompts, [GREEDY] * len(prompts)) == expected
    assert engine.blocks.num_used == 0


def test_qwen2_greedy_matches_transformers_generate(kit: Any, qwen2_dir: Path) -> None:
    prompts = kit.random_prompts([9, 30], seed=3)
    expected = hf_greedy(qwen2_dir, prompts, 64)
    engine = kit.make_engine(qwen2_dir)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    assert kit.run_to_completion(engine, prompts, [params] * 2) == expected


def test_preemption_under_a_tiny_kv_budget_keeps_outputs_identical(kit: Any, llama_dir: Path) -> None:
    prompts = kit.random_prompts([5 + (7 * i) % 40 for i in range(32)], seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True) for _ in prompts]
    # seeded sampling must survive recomputation too
    params[::4] = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=40, ignore_eos=True)
                   for i in range(8)]
    roomy = kit.run_to_completion(kit.make_engine(llama_dir), prompts, params)

    engine = kit.make_engine(llama_dir)
    block_bytes = engine.runner.cache.k[:, 0].numel() * 2 * 4
    tight = kit.make_engine(llama_dir, kv_cache_bytes=24 * block_bytes)  # 24 blocks of 16 tokens for 32 requests
    assert tight.blocks.num_blocks == 24
    assert kit.run_to_completion(tight, prompts, params) == roomy
    stats = tight.stats()
    assert stats.preemptions_total > 0
    assert stats.kv_blocks_used == 0 and tight.blocks.num_free == 24
    assert stats.num_running == stats.num_waiting == 0
    assert stats.generation_tokens_total == 32 * 40


def test_abort_mid_generation_returns_all_blocks(kit: Any, llama_dir: Path) -> None:
    engine = kit.make_engine(llama_dir)
    for i, prompt in enumerate(kit.random_prompts([30, 40, 50, 60])):
        engine.add_request(GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=100, ignore_eos=True)))
    for _ in range(5):
        engine.step()
    assert engine.blocks.num_used > 0
    finals = [engine.abort_request(f"r{i}") for i in range(4)]
    assert all(f is not None and f.finished and f.finish_reason == "abort" for f in finals)
    assert engine.blocks.num_used == 0
    assert not engine.has_unfinished_requests()
    assert engine.abort_request("r0") is None  # aborting twice is harmless


def test_admission_rejects_what_can_never_fit_with_numbers(kit: Any, llama_dir: Path) -> None:
    engine = kit.make_engine(llama_dir, max_model_len=128)
    too_long = GenerationRequest("a", [1] * 100, SamplingParams(max_tokens=50))
    with pytest.raises(RequestRejected, match="150") as err:
        engine.check_admission(too_long)
    assert err.value.kind == "never_fits" and not err.value.retryable
    with pytest.raises(RequestRejected) as err:
        engine.check_admission(GenerationRequest("b", [1], SamplingParams(top_p=0.0)))
    assert err.value.kind == "invalid" and "top_p" in str(err.value)


def test_admission_refuses_when_the_queue_is_full(kit: Any, llama_dir: Path) -> None:
    engine = kit.make_engine(llama_dir, max_queue=2)
    for i in range(2):
        engine.add_request(GenerationRequest(str(i), [1, 2, 3], SamplingParams()))
    with pytest.raises(RequestRejected) as err:
        engine.add_request(GenerationRequest("x", [1, 2, 3], SamplingParams()))
    assert err.value.kind == "queue_full" and err.value.retryable


def test_request_bigger_than_the_whole_cache_never_fits(kit: Any, llama_dir: Path) -> None:
    engine = kit.make_engine(llama_dir)
    tight = kit.make_engine(llama_dir, kv_cache_bytes=engine.runner.cache.k[:, 0].numel() * 2 * 4 * 4)
    with pytest.raises(RequestRejected, match="4 in all") as err:
        tight.check_admission(GenerationRequest("a", [1] * 60, SamplingParams(max_tokens=10)))
    assert err.value.kind == "never_fits"


def test_stop_token_ids_and_logprobs(kit: Any, llama_dir: Path, llama_reference) -> None:
    prompts, expected = llama_reference
    stop_at = expected[0][10]
    first = expected[0].index(stop_at)
    engine = kit.make_engine(llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=[stop_at], logprobs=3)
    engine.add_request(GenerationRequest("s", prompts[0], params))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == expected[0][: first + 1]
    last = outs[-1]
    assert last.finish_reason == "stop" and last.stop_reason == stop_at
    logprobs = [lp for o in outs for lp in (o.logprobs or [])]
    assert len(logprobs) == len(tokens)
    assert all(lp.top_logprobs[0][0] == lp.token_id and len(lp.top_logprobs) == 3 for lp in logprobs)


def test_counters_track_tokens_and_steps(kit: Any, llama_dir: Path) -> None:
    engine = kit.make_engine(llama_dir)
    kit.run_to_completion(engine, kit.random_prompts([10, 20]), [SamplingParams(max_tokens=5, ignore_eos=True)] * 2)
    stats = engine.stats()
    assert stats.prompt_tokens_total == 30
    assert stats.generation_tokens_total == 10
    assert stats.requests_finished_total == 2
    assert stats.steps_total == len(stats.recent_step_durations_s) > 0


def demo_target() -> Path | None:
    from serving.demo import target_path

    path = target_path()
    return path if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file() else None


@pytest.mark.skipif(demo_target() is None, reason="demo target weights not present")
@pytest.mark.parametrize("packing", ["off", "on"])
def test_demo_target_greedy_matches_transformers_generate_for_64_tokens(kit: Any, packing: str) -> None:
    path = demo_target()
    assert path is not None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    texts = ["def fibonacci(n):\n", "import os\nimport sys\n\n\nclass ", "# Copyright"]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    expected = hf_greedy(path, prompts, 64)
    engine = kit.make_engine(path, max_batched_tokens=64, cpu_weight_packing=packing)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    assert kit.run_to_completion(engine, prompts, [params] * len(prompts)) == expected
