"""Penalties and logit bias (serving/engine/logits.py) and their effect on the engine's output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from serving.engine.logits import adjust_logits
from serving.engine.sampling import sample_requests
from serving.engine.types import GenerationRequest, RequestRejected, SamplingParams


def test_penalties_follow_openais_formula_over_the_generated_tokens() -> None:
    logits = torch.zeros(2, 6)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams()]
    out = adjust_logits(logits, params, [[1, 1, 1, 4], [1, 2]])
    # token 1 three times: 3 * 0.25 + 0.5; token 4 once: 0.25 + 0.5; the unpenalized row is untouched
    assert out[0].tolist() == [0.0, -1.25, 0.0, 0.0, -0.75, 0.0]
    assert out[1].tolist() == [0.0] * 6
    assert logits.abs().sum() == 0  # the input is never modified


def test_logit_bias_adds_to_the_named_tokens_only() -> None:
    logits = torch.arange(5, dtype=torch.float32)[None].repeat(2, 1)
    out = adjust_logits(logits, [SamplingParams(logit_bias={0: 100.0, 4: -3.5}), SamplingParams()], [[], []])
    assert out[0].tolist() == [100.0, 1.0, 2.0, 3.0, 0.5]
    assert out[1].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_rows_without_adjustments_cost_nothing() -> None:
    logits = torch.randn(3, 10)
    assert adjust_logits(logits, [SamplingParams()] * 3, [[1], [2], [3]]) is logits


def test_negative_penalties_encourage_repetition() -> None:
    out = adjust_logits(torch.zeros(1, 3), [SamplingParams(presence_penalty=-1.0)], [[2]])
    assert out[0].tolist() == [0.0, 0.0, 1.0]


def test_the_sampler_applies_the_adjustment_to_greedy_and_sampled_rows() -> None:
    logits = torch.tensor([[5.0, 0.0, 0.0], [5.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0),
              SamplingParams(temperature=1.0, logit_bias={0: -100.0, 2: 100.0})]
    keys = [(0, 3), (1, 0)]  # each row's (seed, output position)
    # row 0 generated token 0 three times: 5 - 6 < 0, so token 1 (the first of the ties) wins
    assert sample_requests(logits, params, keys, [[0, 0, 0], []]).tolist() == [1, 2]


@pytest.mark.parametrize("bad", [
    SamplingParams(presence_penalty=2.5), SamplingParams(frequency_penalty=-3.0),
    SamplingParams(logit_bias={1: 101.0}), SamplingParams(logit_bias={-1: 1.0}),
])
def test_out_of_range_values_are_refused_naming_the_field(bad: SamplingParams) -> None:
    with pytest.raises(ValueError, match="penalty|logit_bias"):
        bad.validate()


def test_engine_greedy_output_follows_a_logit_bias(kit: Any, llama_dir: Path) -> None:
    engine = kit.make_engine(llama_dir)
    prompt = kit.random_prompts([7], seed=3)[0]
    plain, biased = kit.run_to_completion(engine, [prompt, prompt], [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={17: 100.0}),
    ])
    assert biased == [17] * 6 and plain != biased


def test_engine_frequency_penalty_stops_greedy_repetition(kit: Any, llama_dir: Path) -> None:
    engine = kit.make_engine(llama_dir)
    prompt = kit.random_prompts([7], seed=3)[0]
    # a bias makes token 17 the greedy choice by a margin of about 5; a penalty of 2 per use overturns it
    base = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={17: 5.0})
    repeated, penalized = kit.run_to_completion(engine, [prompt, prompt], [
        base, SamplingParams(**{**base.__dict__, "frequency_penalty": 2.0})])
    assert repeated.count(17) > 4
    assert penalized.count(17) <= 3


def test_engine_refuses_a_logit_bias_outside_the_vocabulary(kit: Any, llama_dir: Path) -> None:
    engine = kit.make_engine(llama_dir)
    with pytest.raises(RequestRejected, match="logit_bias"):
        engine.add_request(GenerationRequest("x", [1, 2], SamplingParams(logit_bias={10**6: 1.0})))


def test_speculation_keeps_greedy_output_with_penalties_and_bias(kit: Any, llama_dir: Path) -> None:
    """Greedy output with penalties and a logit bias is the same with n-gram drafts (accepted ones) as without.
    (The sampled case, where a verify that does not count the drafts is caught, is the chi-square test.)"""
    from serving.engine.config import SpeculativeConfig

    prompts = [p + p + p for p in kit.random_prompts([6, 9, 5], seed=21)]  # repetitive: n-gram drafts exist
    # negative penalties reward repeating what was generated: the output loops, so drafts are accepted
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, frequency_penalty=-1.0,
                             presence_penalty=-2.0, logit_bias={p[0]: 3.0}) for p in prompts]
    plain = kit.run_to_completion(kit.make_engine(llama_dir), prompts, params)
    engine = kit.make_engine(llama_dir, speculative=SpeculativeConfig(enabled=True, method="ngram",
                                                                      num_draft_tokens=4, adaptive=False))
    assert kit.run_to_completion(engine, prompts, params) == plain
    assert engine.stats().spec.num_accepted_tokens > 10


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_draft_identical_to_the_target_is_always_accepted_under_penalties_and_bias(
    kit: Any, llama_dir: Path, temperature: float
) -> None:
    """The draft model's q gets the same adjustment as the target's p (counting its own earlier drafts)."""
    from serving.engine.config import SpeculativeConfig

    engine = kit.make_engine(llama_dir, speculative=SpeculativeConfig(
        enabled=True, method="draft", draft_model=str(llama_dir), num_draft_tokens=3, adaptive=False))
    prompts = kit.random_prompts([9, 14], seed=8)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=16, ignore_eos=True, frequency_penalty=1.5,
                             presence_penalty=1.0, logit_bias={p[0]: 4.0}) for i, p in enumerate(prompts)]
    kit.run_to_completion(engine, prompts, params)
    spec = engine.stats().spec
    assert spec.num_draft_tokens > 10
    assert spec.acceptance_rate > 0.99
