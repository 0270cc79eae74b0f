"""Prompt logprobs (what completions `echo` + `logprobs` report): collected chunk by chunk during prefill."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from serving.engine.engine import LLMEngine
from serving.engine.types import GenerationRequest, RequestOutput, SamplingParams


def offline_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1] log p(prompt[i + 1] | prompt[: i + 1]) from the HF reference implementation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    return logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)


def run(engine: LLMEngine, requests: list[GenerationRequest]) -> dict[str, list[RequestOutput]]:
    for r in requests:
        engine.add_request(r)
    outs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_prompt_logprobs_match_the_reference_model_across_prefill_chunks(
    kit: Any, llama_dir: Path, max_tokens: int
) -> None:
    prompt = kit.random_prompts([45], seed=5)[0]
    engine = kit.make_engine(llama_dir, max_batched_tokens=16, max_concurrency=4)  # three prefill chunks
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=3, logprobs=1)
    outs = run(engine, [GenerationRequest("a", prompt, params),
                        GenerationRequest("b", kit.random_prompts([30], seed=6)[0], SamplingParams(max_tokens=4))])
    first = outs["a"][0]
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(prompt)
    assert first.prompt_logprobs[0] is None
    got = torch.tensor([e.logprob for e in first.prompt_logprobs[1:]])  # type: ignore[union-attr]
    torch.testing.assert_close(got, offline_logprobs(llama_dir, prompt), atol=1e-4, rtol=1e-4)
    for entry, token in zip(first.prompt_logprobs[1:], prompt[1:], strict=True):
        assert entry is not None and entry.token_id == token and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0][1] >= entry.logprob - 1e-6
    assert all(o.prompt_logprobs is None for o in outs["a"][1:])  # sent once
    assert sum(len(o.new_token_ids) for o in outs["a"]) == max_tokens
    assert outs["a"][-1].finish_reason == "length"


def test_a_cached_prefix_does_not_skip_prompt_logprobs(kit: Any, llama_dir: Path) -> None:
    prompt = kit.random_prompts([40], seed=7)[0]
    engine = kit.make_engine(llama_dir, enable_prefix_caching=True)
    run(engine, [GenerationRequest("warm", prompt, SamplingParams(max_tokens=1))])
    params = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=0)
    entries = run(engine, [GenerationRequest("scored", prompt, params)])["scored"][0].prompt_logprobs
    assert entries is not None and len(entries) == len(prompt)
    got = torch.tensor([e.logprob for e in entries[1:]])  # type: ignore[union-attr]
    torch.testing.assert_close(got, offline_logprobs(llama_dir, prompt), atol=1e-4, rtol=1e-4)


def test_max_tokens_zero_needs_prompt_logprobs() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0).validate()
    SamplingParams(max_tokens=0, prompt_logprobs=0).validate()
