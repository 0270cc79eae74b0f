from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from serving.engine.sampling import SamplingRows, greedy_tokens, logits_to_probs, position_noise, race, sample
from serving.engine.types import GenerationRequest, SamplingParams


def rows_for(*params: SamplingParams, vocab: int = 4) -> SamplingRows:
    return SamplingRows.from_params(list(params), vocab, torch.device("cpu"))


def test_top_k_keeps_the_k_most_likely() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    probs = logits_to_probs(logits, rows_for(SamplingParams(top_k=2)))
    assert torch.equal(probs[0] > 0, torch.tensor([False, True, True, False]))
    assert torch.allclose(probs.sum(), torch.tensor(1.0))


def test_top_p_keeps_the_smallest_nucleus_reaching_p() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    keep = logits_to_probs(logits, rows_for(SamplingParams(top_p=0.7)))[0] > 0
    assert keep.tolist() == [True, True, False, False]
    keep = logits_to_probs(logits, rows_for(SamplingParams(top_p=0.5)))[0] > 0
    assert keep.tolist() == [True, False, False, False]


def test_rows_get_their_own_parameters_and_greedy_rows_take_argmax() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3)
    rows = rows_for(SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(temperature=0.5))
    probs = logits_to_probs(logits, rows)
    assert probs[0].tolist() == [0, 0, 0, 1] and probs[1].tolist() == [0, 0, 0, 1]
    assert (probs[2] > 0).all()
    assert sample(logits, rows, [(i, 0) for i in range(3)])[:2].tolist() == [3, 3]


def test_the_exponential_race_follows_the_distribution() -> None:
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3]]).expand(20000, 4)
    tokens = race(probs, position_noise([(seed, 7) for seed in range(20000)], 4, torch.device("cpu")))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert freq[1] == 0
    assert torch.allclose(freq, probs[0], atol=0.015)


def test_a_positions_noise_depends_on_its_seed_and_position_alone() -> None:
    cpu = torch.device("cpu")
    one = position_noise([(5, 3)], 64, cpu)
    assert torch.equal(position_noise([(1, 0), (5, 3), (9, 9)], 64, cpu)[1], one[0])  # neighbours do not matter
    assert not torch.equal(position_noise([(5, 4)], 64, cpu), one)
    assert not torch.equal(position_noise([(6, 3)], 64, cpu), one)
    assert not torch.equal(position_noise([(-(2**63), 3)], 64, cpu), one)  # the whole signed range is a seed
    assert bool((one > 0).all()) and bool(torch.isfinite(one).all())


def test_seeded_output_does_not_depend_on_batch_neighbours(kit: Any, llama_dir: Path) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    prompt = kit.random_prompts([12])[0]
    alone = kit.run_to_completion(kit.make_engine(llama_dir), [prompt], [params])[0]
    others = kit.random_prompts([5, 30, 17], seed=9)
    crowd = kit.run_to_completion(
        kit.make_engine(llama_dir),
        others + [prompt],
        [SamplingParams(temperature=0.7, max_tokens=30, ignore_eos=True)] * 3 + [params],
    )[-1]
    assert alone == crowd
    different_seed = kit.run_to_completion(
        kit.make_engine(llama_dir), [prompt],
        [SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=24, ignore_eos=True)])[0]
    assert different_seed != alone


def test_unseeded_requests_differ_from_each_other(kit: Any, llama_dir: Path) -> None:
    engine = kit.make_engine(llama_dir)
    prompt = kit.random_prompts([8])[0]
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    for rid in ("a", "b"):
        engine.add_request(GenerationRequest(rid, prompt, params))
    got: dict[str, list[int]] = {"a": [], "b": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert got["a"] != got["b"]


def test_greedy_tokens_are_argmax_ties_nan_and_dtypes_included() -> None:
    """greedy_tokens takes max(dim).indices on CPU (~3x faster than argmax from a few rows on): it must pick the
    same token as argmax everywhere, or greedy outputs would change."""
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 9, 64):
        logits = torch.randn(rows, 4096, generator=gen)
        assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
        assert torch.equal(greedy_tokens(logits.bfloat16()), logits.bfloat16().argmax(dim=-1))
    tied = torch.zeros(4, 4096)
    tied[0, [7, 900, 4000]] = 3.0  # several maxima: the first
    tied[1] = 0.5  # all equal
    tied[2, [11, 3000]] = float("nan")  # NaN counts as the maximum, the first one
    tied[2, 5] = 9.0
    tied[3] = float("-inf")
    tied[3, 4095] = -1e30
    expected = tied.argmax(dim=-1)
    assert expected.tolist() == [7, 0, 11, 4095]
    assert torch.equal(greedy_tokens(tied), expected)
