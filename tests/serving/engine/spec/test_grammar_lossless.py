"""Speculative sampling stays lossless under a grammar mask: the 2nd and 3rd tokens of constrained generations
(drafted by a small draft model, verified by the target) follow the masked target distribution exactly."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import xgrammar as xgr

from serving.engine import grammar as grammar_module
from serving.engine.config import SpeculativeConfig
from serving.engine.logits import adjust_logits
from serving.engine.sampling import SamplingRows, logits_to_probs
from serving.engine.spec import speculator as speculator_module
from serving.engine.types import GenerationRequest, SamplingParams

VOCAB = 8
LETTERS = ["<eos>"] + [chr(ord("a") + i) for i in range(VOCAB - 1)]  # token t > 0 is letter t - 1
# which letters may follow depends on the letters before: position 2 on position 1, position 3 on both
EBNF = 'root ::= [a-d] ([a-c] [d-g] | [d-g] [a-c]) | [e-g] [a-g] [a-b]'
PROMPT = [1, 5, 2, 7]
CHI2_CRITICAL_DF7 = 24.32  # p = 0.001


def allowed(prefix: list[int]) -> set[int]:
    """The grammar above, written out by hand: the tokens allowed after the generated tokens `prefix`."""
    ids = {c: LETTERS.index(c) for c in LETTERS[1:]}
    span = lambda lo, hi: {ids[chr(c)] for c in range(ord(lo), ord(hi) + 1)}  # noqa: E731
    if not prefix:
        return span("a", "g")
    first = LETTERS[prefix[0]]
    if len(prefix) == 1:
        return span("a", "g")
    second = LETTERS[prefix[1]]
    if first <= "d":
        return span("d", "g") if second <= "c" else span("a", "c")
    return span("a", "b")


def compiled() -> xgr.CompiledGrammar:
    info = xgr.TokenizerInfo(LETTERS, vocab_size=VOCAB, stop_token_ids=[0])
    return xgr.GrammarCompiler(info).compile_grammar(EBNF)


@pytest.fixture(scope="module")
def pair(kit: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target = kit.save_tiny_model(tmp_path_factory.mktemp("g-target"), "llama", vocab_size=VOCAB, initializer_range=0.3)
    draft = kit.save_tiny_model(tmp_path_factory.mktemp("g-draft"), "llama", vocab_size=VOCAB, num_hidden_layers=1,
                                hidden_size=32, intermediate_size=48, initializer_range=0.3)
    return target, draft


def exact_marginals(target: Path, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Distributions of the 2nd and 3rd generated tokens under the target, adjusted, then masked by `allowed`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor(prefixes)).logits[:, -1].float()
        # penalties and bias count the tokens generated before each row; the grammar mask comes on top
        logits = adjust_logits(logits, [params] * len(prefixes), [prefix[len(PROMPT):] for prefix in prefixes])
        for row, prefix in enumerate(prefixes):
            keep = allowed(prefix[len(PROMPT):])
            logits[row, [t for t in range(VOCAB) if t not in keep]] = float("-inf")
        return logits_to_probs(logits, SamplingRows.from_params([params] * len(prefixes), VOCAB, torch.device("cpu")))

    p1 = next_probs([PROMPT])[0]
    p2_given_1 = next_probs([PROMPT + [a] for a in range(VOCAB)])
    p3_given_12 = next_probs([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    joint12 = torch.nan_to_num(p1[:, None] * p2_given_1)  # rows of impossible first tokens are NaN (all masked)
    p3 = torch.nan_to_num(joint12.reshape(-1, 1) * p3_given_12).sum(0)
    return joint12.sum(0), p3


def sample_marginals(kit: Any, target: Path, draft: Path, params: SamplingParams, n: int,
                     token_map: str | None = None, seeded: bool = True) -> torch.Tensor:
    """seeded: verification by the coupled rule; unseeded: by rejection sampling (spec/rejection.py)."""
    engine = kit.make_engine(target, speculative=SpeculativeConfig(
        enabled=True, method="draft", draft_model=str(draft), adaptive=False, num_draft_tokens=2,
        draft_token_map=token_map), max_concurrency=256, max_batched_tokens=1024, max_queue=n)
    grammar = compiled()
    for i in range(n):
        engine.add_request(GenerationRequest(str(i), PROMPT, dataclasses.replace(params, seed=i if seeded else None,
                                                                                 max_tokens=3),
                                             grammar=grammar))
    got: dict[str, list[int]] = {str(i): [] for i in range(n)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert engine.stats().spec.num_drafts > n // 2  # the 2nd/3rd tokens really went through verification
    counts = torch.zeros(2, VOCAB)
    for tokens in got.values():
        assert len(tokens) == 3
        assert tokens[1] in allowed(tokens[:1]) and tokens[2] in allowed(tokens[:2])
        counts[0, tokens[1]] += 1
        counts[1, tokens[2]] += 1
    return counts


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 1e-9
    assert counts[~keep].sum() == 0, "a token outside the masked target's support was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("seeded", [True, False], ids=["coupled", "rejection"])
@pytest.mark.parametrize("params", [
    pytest.param(SamplingParams(temperature=1.0), id="t1"),
    pytest.param(SamplingParams(temperature=0.8, top_k=5, top_p=0.9, presence_penalty=1.5, logit_bias={3: 2.0}),
                 id="topk-topp-penalty-bias"),
])
def test_speculative_sampling_keeps_the_masked_target_distribution(
    kit: Any, pair: tuple[Path, Path], params: SamplingParams, seeded: bool
) -> None:
    target, draft = pair
    p2, p3 = exact_marginals(target, params)
    counts = sample_marginals(kit, target, draft, params, 1500, seeded=seeded)
    assert chi_square(counts[0], p2) < CHI2_CRITICAL_DF7
    assert chi_square(counts[1], p3) < CHI2_CRITICAL_DF7


def test_verify_rows_must_be_masked_after_the_drafts_before_them(
    kit: Any, pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verify that masks every row with the state before the drafts lets ungrammatical tokens through."""
    def mask_without_advancing(logits: torch.Tensor, grammars: Any, drafts: Any) -> None:
        grammar_module.mask_verify_rows(logits, grammars, [[] for _ in drafts])
        start = 0
        for grammar, draft in zip(grammars, drafts, strict=True):
            rows = list(range(start + 1, start + len(draft) + 1))
            if grammar is not None and rows:  # later rows get the first row's mask
                logits[rows] = torch.where(torch.isinf(logits[start]), logits[start], logits[rows])
            start += len(draft) + 1

    monkeypatch.setattr(speculator_module, "mask_verify_rows", mask_without_advancing)
    target, draft = pair
    with pytest.raises(AssertionError):
        sample_marginals(kit, target, draft, SamplingParams(temperature=1.0), 300)


def test_unmasked_sampled_drafts_cut_after_their_first_rejected_token_stay_lossless(
    kit: Any, pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draft model follows the grammar too; without that, its ungrammatical drafts are kept up to the first
    rejected one (rejected by the masked target for certain) and the output is still exactly distributed
    (unseeded: rejection sampling, where the cut matters)."""
    from serving.engine.spec import draft as draft_module

    monkeypatch.setattr(draft_module, "apply_grammar_masks", lambda logits, grammars: logits)
    target, draft = pair
    params = SamplingParams(temperature=1.0)
    p2, p3 = exact_marginals(target, params)
    counts = sample_marginals(kit, target, draft, params, 1500, seeded=False)
    assert chi_square(counts[0], p2) < CHI2_CRITICAL_DF7
    assert chi_square(counts[1], p3) < CHI2_CRITICAL_DF7


@pytest.mark.parametrize("seeded", [True, False], ids=["coupled", "rejection"])
def test_a_draft_with_a_token_map_keeps_the_masked_target_distribution(
    kit: Any, pair: tuple[Path, Path], tmp_path: Path, seeded: bool
) -> None:
    """speculative.draft_token_map: the draft proposes only <eos>, a, b, c, so its q is 0 for d-g, which the
    grammar allows as the second letter; the output is still exactly the masked target's (rejection sampling
    draws d-g from the residual)."""
    import shutil

    target, draft = pair
    mapped = tmp_path / "draft"
    shutil.copytree(draft, mapped)
    (mapped / "token_map.json").write_text("[0, 1, 2, 3]")
    params = SamplingParams(temperature=1.0)
    p2, p3 = exact_marginals(target, params)
    counts = sample_marginals(kit, target, mapped, params, 1500, token_map="token_map.json", seeded=seeded)
    assert chi_square(counts[0], p2) < CHI2_CRITICAL_DF7
    assert chi_square(counts[1], p3) < CHI2_CRITICAL_DF7
