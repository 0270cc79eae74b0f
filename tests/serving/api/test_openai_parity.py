"""OpenAI parity (issue 16): n > 1, penalties, logit_bias, completions echo + prompt logprobs, best_of and
harmless extras, through the official `openai` client (and the exact request lm-evaluation-harness sends)."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

MODEL_NAME = "tiny"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"


@pytest.fixture
def client(server: Any, api_keys: dict[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=api_keys["alice"], max_retries=0, timeout=60)


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}],
                                          **kwargs)


# ---- n > 1 ------------------------------------------------------------------------------------------------


def test_chat_n3_returns_three_indexed_choices_each_with_its_own_generator(client: openai.OpenAI) -> None:
    response = chat(client, n=3, max_tokens=12, temperature=1.0, seed=7)
    assert [c.index for c in response.choices] == [0, 1, 2]
    texts = [c.message.content for c in response.choices]
    assert len(set(texts)) > 1  # each choice samples from its own generator (seed + index)
    # seed + index: choice i of a seeded n=3 request is the n=1 request with seed 7 + i
    for i in range(3):
        single = chat(client, n=1, max_tokens=12, temperature=1.0, seed=7 + i)
        assert single.choices[0].message.content == texts[i]


def test_n3_usage_counts_the_prompt_once(client: openai.OpenAI) -> None:
    one = chat(client, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    three = chat(client, n=3, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens == 15
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}  # greedy: alike


def test_n_choices_share_the_prompts_kv_blocks(client: openai.OpenAI, server: Any) -> None:
    prompt = PROMPT * 3 + "# a prompt no other test sends\n"
    hits = server.metric("specdeploy_prefix_cache_hits_total")
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, n=4, max_tokens=4, temperature=1.0)
    gained = server.metric("specdeploy_prefix_cache_hits_total") - hits
    block = 16  # the default kv_block_size
    shared = (response.usage.prompt_tokens - 1) // block * block  # full blocks a sibling can take from the cache
    assert shared > 0
    assert gained >= 3 * shared  # every sibling after the first found the whole shared prefix


def test_streamed_chat_n2_sends_chunks_per_index_equal_to_the_whole_answer(client: openai.OpenAI) -> None:
    kwargs = dict(n=2, max_tokens=16, temperature=1.0, seed=3)
    whole = chat(client, **kwargs)
    streamed = ["", ""]
    finish: dict[int, str] = {}
    for chunk in chat(client, stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert streamed == [c.message.content for c in whole.choices]
    assert finish == {c.index: c.finish_reason for c in whole.choices}


def test_streamed_completion_n2_sends_chunks_per_index(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, n=2, max_tokens=10, temperature=1.0, seed=11)
    whole = client.completions.create(**kwargs)  # type: ignore[call-overload]
    streamed = ["", ""]
    for chunk in client.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]


def test_best_of_returns_n_of_the_candidates(client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, best_of=3, n=1, max_tokens=6,
                                         temperature=1.0, seed=5)
    assert len(response.choices) == 1 and response.choices[0].logprobs is None  # logprobs were not asked for
    candidates = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=3, max_tokens=6, temperature=1.0,
                                           seed=5, logprobs=0)

    def mean(c: Any) -> float:
        return sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs)

    best = max(candidates.choices, key=mean)
    assert response.choices[0].text == best.text


# ---- penalties and logit_bias -----------------------------------------------------------------------------


def completion_tokens(client: openai.OpenAI, **kwargs: Any) -> list[str]:
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0,
                                         extra_body={"ignore_eos": True}, **kwargs)
    return list(response.choices[0].logprobs.tokens)


def test_logit_bias_forces_a_token(client: openai.OpenAI) -> None:
    forced = completion_tokens(client, logit_bias={"300": 100})
    assert len(set(forced)) == 1 and forced != completion_tokens(client)


def test_frequency_and_presence_penalties_break_greedy_repetition(client: openai.OpenAI) -> None:
    plain = completion_tokens(client)
    penalized = completion_tokens(client, frequency_penalty=2.0, presence_penalty=2.0)
    assert max(Counter(penalized).values()) < max(Counter(plain).values())
    assert len(set(penalized)) > len(set(plain))


# ---- echo and prompt logprobs (lm-evaluation-harness loglikelihood) -----------------------------------------


def offline_logprobs(model_dir: Path, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, from the reference implementation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()


@pytest.mark.parametrize("max_tokens", [0, 1])  # lm-eval sends max_tokens=1 (and drops the last entry); 0 too
def test_lm_eval_loglikelihood_request_returns_the_offline_logprobs(
    server: Any, tiny_chat_model: Path, max_tokens: int
) -> None:
    ids = [17, 402, 93, 1200, 5, 77, 3000, 45, 45, 46, 812, 9, 10, 11, 2048, 64, 65, 66, 67, 68]
    # the exact body lm_eval's local-completions loglikelihood builds (tokenized_requests=True, batch of one)
    body = {"model": MODEL_NAME, "prompt": [ids], "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
            "seed": 1234, "echo": True}
    with server.client() as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(ids) + max_tokens
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    got = logprobs["token_logprobs"][1 : len(ids)]
    assert got == pytest.approx(offline_logprobs(tiny_chat_model, ids), abs=1e-4)
    # lm-eval's is_greedy check: the token's logprob against the best of top_logprobs
    for lp, top in zip(got, logprobs["top_logprobs"][1 : len(ids)], strict=True):
        assert len(top) == 1 and max(top.values()) >= lp - 1e-6
    assert response.json()["usage"]["completion_tokens"] == max_tokens


def test_a_batch_of_prompts_gets_each_prompts_logprobs_in_prompt_order(server: Any) -> None:
    """lm-eval with batch_size > 1 sends several token prompts in one request."""
    batch = [[17, 402, 93, 1200, 5, 77], [3000, 45, 45, 46], [812, 9, 10, 11, 2048, 64, 65]]
    body = {"model": MODEL_NAME, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    with server.client() as http:
        together = http.post("/v1/completions", json={**body, "prompt": batch}).json()
        alone = [http.post("/v1/completions", json={**body, "prompt": [ids]}).json() for ids in batch]
    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    for choice, single, ids in zip(together["choices"], alone, batch, strict=True):
        assert len(choice["logprobs"]["token_logprobs"]) == len(ids) + 1
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
            single["choices"][0]["logprobs"]["token_logprobs"][1:], abs=1e-5)
    assert together["usage"]["prompt_tokens"] == sum(len(ids) for ids in batch)


def test_a_batch_of_prompts_with_n2_indexes_choices_prompt_by_prompt(client: openai.OpenAI) -> None:
    prompts = ["def add(a, b):", "import os\n"]
    response = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, echo=True, max_tokens=3,
                                         temperature=1.0, seed=4)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text.startswith(prompts[c.index // 2]) for c in response.choices] == [True] * 4


def test_echo_with_the_client_repeats_the_prompt_before_the_completion(client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3,
                                         temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == response.usage.prompt_tokens + 3
    assert logprobs.token_logprobs[0] is None and all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_streamed_echo_sends_the_prompt_first(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, max_tokens=4,
                                            temperature=0, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, max_tokens=4, temperature=0)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


# ---- no silent drops: harmless extras are still accepted ----------------------------------------------------


def test_harmless_openai_extras_are_ignored(client: openai.OpenAI) -> None:
    response = chat(client, max_tokens=3, temperature=0, store=True, metadata={"run": "ci"}, service_tier="auto",
                    user="u-1", reasoning_effort="low", parallel_tool_calls=True,
                    extra_body={"modalities": ["text"], "prompt_cache_key": "k", "safety_identifier": "s"})
    assert response.choices[0].message.content is not None


# ---- a client that leaves stops every choice ----------------------------------------------------------------


def wait_until_idle(server: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while server.metric("specdeploy_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_leaving_an_n3_request_frees_every_choice(server: Any, stream: bool) -> None:
    idle = server.metric("specdeploy_kv_blocks_used")
    generated = server.metric("specdeploy_generation_tokens_total")
    body = {"model": MODEL_NAME, "prompt": PROMPT, "n": 3, "max_tokens": 1000, "ignore_eos": True,
            "temperature": 1.0, "stream": stream}
    with server.client(timeout=None if stream else 0.5) as http:
        if stream:
            with http.stream("POST", "/v1/completions", json=body) as response:
                seen: set[int] = set()
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        seen |= {c["index"] for c in json.loads(line[6:])["choices"]}
                    if seen == {0, 1, 2}:
                        break  # every choice is running; leaving the block closes the connection
        else:
            with pytest.raises(httpx.TimeoutException):
                http.post("/v1/completions", json=body)
    wait_until_idle(server)
    assert server.metric("specdeploy_requests_running") == 0
    assert server.metric("specdeploy_kv_blocks_used") == idle
    assert server.metric("specdeploy_generation_tokens_total") - generated < 3 * 1000 / 2  # cut short
