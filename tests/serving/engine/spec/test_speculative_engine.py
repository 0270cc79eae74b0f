from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from serving.engine.config import SpeculativeConfig
from serving.engine.engine import LLMEngine
from serving.engine.logits import adjust_logits
from serving.engine.sampling import SamplingRows, logits_to_probs
from serving.engine.spec import speculator as speculator_module
from serving.engine.spec.draft import DraftMismatchError, DraftModelProposer
from serving.engine.types import GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def small_draft_dir(kit: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A different, smaller random model: its drafts are mostly rejected."""
    return kit.save_tiny_model(tmp_path_factory.mktemp("draft"), "llama", num_hidden_layers=1, hidden_size=32,
                               intermediate_size=48)


def spec_engine(kit: Any, model_dir: Path, **spec: Any) -> LLMEngine:
    overrides = {k: spec.pop(k) for k in ("kv_cache_bytes", "max_batched_tokens", "max_concurrency", "max_queue")
                 if k in spec}
    return kit.make_engine(model_dir, speculative=SpeculativeConfig(enabled=True, **spec), **overrides)


def repetitive_prompts(kit: Any, n: int) -> list[list[int]]:
    """Prompts that repeat themselves, so n-gram lookup finds matches."""
    return [p + p[: len(p) // 2] + p for p in kit.random_prompts([4 + (5 * i) % 23 for i in range(n)], seed=11)]


def block_bytes(engine: LLMEngine) -> int:
    return engine.runner.cache.k[:, 0].numel() * 2 * engine.runner.cache.k.element_size()


def assert_block_accounting(engine: LLMEngine) -> None:
    """Every block is owned by exactly one running sequence, each table exactly as long as it must be."""
    blocks = engine.blocks
    tables = [blocks.block_table(r.request_id) for r in engine.scheduler.running]
    owned = [b for t in tables for b in t]
    assert len(owned) == len(set(owned)) == blocks.num_used
    for req in engine.scheduler.running:
        assert len(blocks.block_table(req.request_id)) == blocks.blocks_for(req.num_computed_tokens)
    proposer = engine.speculator.proposer if engine.speculator else None
    if isinstance(proposer, DraftModelProposer):
        for rid, computed in proposer.computed.items():
            assert len(proposer.blocks.block_table(rid)) == proposer.blocks.blocks_for(computed)


SPEC_CONFIGS = [
    pytest.param(dict(method="ngram", adaptive=False, num_draft_tokens=4), id="ngram-fixed"),
    pytest.param(dict(method="ngram", adaptive=True, num_draft_tokens=4), id="ngram-adaptive"),
    pytest.param(dict(method="draft", adaptive=False, num_draft_tokens=3, draft="target"), id="draft-same-fixed"),
    pytest.param(dict(method="draft", adaptive=False, num_draft_tokens=3, draft="small"), id="draft-small-fixed"),
    pytest.param(dict(method="draft", adaptive=True, num_draft_tokens=3, draft="small"), id="draft-small-adaptive"),
]


@pytest.mark.parametrize("spec", SPEC_CONFIGS)
def test_greedy_output_is_identical_with_speculation_on_and_off_under_preemption(
    kit: Any, llama_dir: Path, small_draft_dir: Path, spec: dict
) -> None:
    prompts = repetitive_prompts(kit, 12)
    # every third request opts out: batches mix speculating and plain decoding sequences
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, speculative=i % 3 != 2)
              for i in range(len(prompts))]
    expected = kit.run_to_completion(kit.make_engine(llama_dir), prompts, params)

    spec = dict(spec)
    draft = spec.pop("draft", None)
    if draft:
        spec["draft_model"] = str(llama_dir if draft == "target" else small_draft_dir)
    probe = kit.make_engine(llama_dir)
    engine = spec_engine(kit, llama_dir, kv_cache_bytes=14 * block_bytes(probe), max_batched_tokens=48, **spec)
    assert kit.run_to_completion(engine, prompts, params, after_step=assert_block_accounting) == expected

    stats = engine.stats()
    assert stats.preemptions_total > 0
    assert stats.spec.num_draft_tokens > 0
    assert engine.blocks.num_used == 0
    if isinstance(engine.speculator.proposer, DraftModelProposer):
        assert engine.speculator.proposer.blocks.num_used == 0
        assert not engine.speculator.proposer.computed


def test_block_accounting_stays_exact_over_a_long_run_with_many_rejections(
    kit: Any, llama_dir: Path, small_draft_dir: Path
) -> None:
    engine = spec_engine(kit, llama_dir, method="draft", draft_model=str(small_draft_dir), adaptive=False,
                         num_draft_tokens=4)
    prompts = kit.random_prompts([3 + i for i in range(16)], seed=5)
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=60, ignore_eos=True) for i in range(16)]
    kit.run_to_completion(engine, prompts, params, after_step=assert_block_accounting)
    spec = engine.stats().spec
    assert spec.num_draft_tokens - spec.num_accepted_tokens > 100  # many rejections happened
    assert engine.blocks.num_used == 0 and engine.speculator.proposer.blocks.num_used == 0


def test_abort_frees_target_and_draft_blocks(kit: Any, llama_dir: Path, small_draft_dir: Path) -> None:
    engine = spec_engine(kit, llama_dir, method="draft", draft_model=str(small_draft_dir), adaptive=False)
    for i, prompt in enumerate(kit.random_prompts([20, 30])):
        engine.add_request(GenerationRequest(str(i), prompt, SamplingParams(max_tokens=100, ignore_eos=True)))
    for _ in range(4):
        engine.step()
    assert engine.speculator.proposer.blocks.num_used > 0
    for i in range(2):
        engine.abort_request(str(i))
    assert engine.blocks.num_used == 0 and engine.speculator.proposer.blocks.num_used == 0


def test_the_draft_never_reads_past_what_the_target_verified(kit: Any, llama_dir: Path, small_draft_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Rejected drafts leave the draft's cache before it drafts again, whether the target verified them or the
    scheduler dropped them: with four requests drafting 4 tokens each and a budget of 16 tokens a step, three verify
    their drafts (15 tokens) and the fourth decodes its one token without its drafts. The draft's cache holds no
    more of a sequence than the target has verified whenever it is asked for new drafts."""
    engine = spec_engine(kit, llama_dir, method="draft", draft_model=str(small_draft_dir), adaptive=False,
                         num_draft_tokens=4, max_batched_tokens=16, max_concurrency=4)
    proposer = engine.speculator.proposer
    propose = proposer.propose
    dropped = 0

    def checked(reqs: list[Any], ks: dict[str, int]) -> Any:
        for req in reqs:
            view = req.num_computed_tokens - proposer.offset.get(req.request_id, 0)
            assert proposer.computed.get(req.request_id, 0) <= view, req.request_id
        return propose(reqs, ks)

    monkeypatch.setattr(proposer, "propose", checked)
    prompts = kit.random_prompts([6 + i for i in range(4)], seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True) for _ in prompts]
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(GenerationRequest(str(i), prompt, p))
    sched_spec: dict[str, list[int]] = {}
    schedule = engine.scheduler.schedule

    def spy(*a: Any, **kw: Any) -> Any:
        out = schedule(*a, **kw)
        sched_spec.update(out.spec_token_ids)
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", spy)
    while engine.has_unfinished_requests():
        drafted = {r.request_id for r in engine.scheduler.running if r.spec_token_ids}
        sched_spec.clear()
        engine.step()
        dropped += sum(rid not in sched_spec for rid in drafted)  # scheduled or not, its drafts were not verified
    assert dropped > 10  # the case the test is about happened
    assert engine.stats().spec.num_draft_tokens > 0


def test_a_draft_with_another_vocabulary_is_refused_at_load(kit: Any, llama_dir: Path, tmp_path: Path) -> None:
    other = kit.save_tiny_model(tmp_path, "llama", vocab_size=64, num_hidden_layers=1)
    with pytest.raises(DraftMismatchError, match="vocab_size"):
        spec_engine(kit, llama_dir, method="draft", draft_model=str(other))


# ---- the sampled output distribution is the target's ---------------------------------------------------

SMALL_VOCAB = 8
PROMPT = [1, 5, 2, 7]
CHI2_CRITICAL_DF7 = 24.32  # p = 0.001


@pytest.fixture(scope="module")
def small_vocab_pair(kit: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target = kit.save_tiny_model(tmp_path_factory.mktemp("sv-target"), "llama", vocab_size=SMALL_VOCAB,
                                 initializer_range=0.3)
    draft = kit.save_tiny_model(tmp_path_factory.mktemp("sv-draft"), "llama", vocab_size=SMALL_VOCAB,
                                num_hidden_layers=1, hidden_size=32, intermediate_size=48, initializer_range=0.3)
    return target, draft


def exact_marginals(target: Path, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Distributions of the 2nd and 3rd generated tokens under the target's processed distribution."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor(prefixes)).logits[:, -1].float()
        # penalties count the tokens generated before each row (the prompt does not count)
        logits = adjust_logits(logits, [params] * len(prefixes), [prefix[len(PROMPT):] for prefix in prefixes])
        rows = SamplingRows.from_params([params] * len(prefixes), SMALL_VOCAB, torch.device("cpu"))
        return logits_to_probs(logits, rows)

    p1 = next_probs([PROMPT])[0]  # [V]
    p2_given_1 = next_probs([PROMPT + [a] for a in range(SMALL_VOCAB)])  # [V, V]
    p3_given_12 = next_probs([PROMPT + [a, b] for a in range(SMALL_VOCAB) for b in range(SMALL_VOCAB)])
    joint12 = p1[:, None] * p2_given_1  # [V, V]
    p2 = joint12.sum(0)
    p3 = (joint12.reshape(-1, 1) * p3_given_12).sum(0)
    return p2, p3


def sample_marginals(kit: Any, target: Path, draft: Path, params: SamplingParams, n: int,
                     seeded: bool = True) -> torch.Tensor:
    """seeded: verification by the coupled rule; unseeded: by rejection sampling (spec/rejection.py)."""
    engine = spec_engine(kit, target, method="draft", draft_model=str(draft), adaptive=False, num_draft_tokens=2,
                         max_concurrency=256, max_batched_tokens=1024, max_queue=n)
    outs = kit.run_to_completion(
        engine, [PROMPT] * n,
        [dataclasses.replace(params, seed=i if seeded else None, max_tokens=3, ignore_eos=True) for i in range(n)],
    )
    assert engine.stats().spec.num_drafts > n // 2  # the 2nd/3rd tokens really went through verification
    counts = torch.zeros(2, SMALL_VOCAB)
    for tokens in outs:
        counts[0, tokens[1]] += 1
        counts[1, tokens[2]] += 1
    return counts


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 1e-9
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


SAMPLED = [
    pytest.param(SamplingParams(temperature=1.0), id="t1"),
    pytest.param(SamplingParams(temperature=0.8, top_k=5, top_p=0.9), id="topk-topp"),
    # strong penalties make the 3rd token's distribution depend on the 1st and 2nd (drafts, when verified)
    pytest.param(SamplingParams(temperature=1.0, presence_penalty=1.5, frequency_penalty=1.0,
                                logit_bias={3: 2.0, 0: -1.0}), id="penalties-logit-bias"),
]


@pytest.mark.parametrize("seeded", [True, False], ids=["coupled", "rejection"])
@pytest.mark.parametrize("params", SAMPLED)
def test_speculative_sampling_keeps_the_target_distribution(
    kit: Any, small_vocab_pair: tuple[Path, Path], params: SamplingParams, seeded: bool
) -> None:
    target, draft = small_vocab_pair
    p2, p3 = exact_marginals(target, params)
    counts = sample_marginals(kit, target, draft, params, 1500, seeded)
    assert chi_square(counts[0], p2) < CHI2_CRITICAL_DF7
    assert chi_square(counts[1], p3) < CHI2_CRITICAL_DF7


def test_the_distribution_test_detects_a_broken_acceptance_rule(
    kit: Any, small_vocab_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def accept_everything(target_tokens: list[int], drafts: list[int]) -> list[int]:
        return drafts + [target_tokens[len(drafts)]]

    monkeypatch.setattr(speculator_module, "accept_drafts", accept_everything)
    target, draft = small_vocab_pair
    params = SamplingParams(temperature=1.0)
    p2, _ = exact_marginals(target, params)
    counts = sample_marginals(kit, target, draft, params, 1500)
    assert chi_square(counts[0], p2) > CHI2_CRITICAL_DF7


def test_the_distribution_test_detects_a_broken_rejection_rule(
    kit: Any, small_vocab_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def accept_everything(p: torch.Tensor, drafts: list[int], q: Any, generator: torch.Generator) -> list[int]:
        return drafts + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))]

    monkeypatch.setattr(speculator_module, "rejection_sample", accept_everything)
    target, draft = small_vocab_pair
    params = SamplingParams(temperature=1.0)
    p2, _ = exact_marginals(target, params)
    counts = sample_marginals(kit, target, draft, params, 1500, seeded=False)
    assert chi_square(counts[0], p2) > CHI2_CRITICAL_DF7


def test_the_distribution_test_detects_penalties_that_ignore_the_drafts(
    kit: Any, small_vocab_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verify rows must count the tokens generated before them, drafts included; a verify that does not is caught."""
    def without_drafts(logits: torch.Tensor, params: Any, histories: Any) -> torch.Tensor:
        return adjust_logits(logits, params, [[] for _ in histories])

    monkeypatch.setattr(speculator_module, "adjust_logits", without_drafts)
    target, draft = small_vocab_pair
    params = SamplingParams(temperature=1.0, presence_penalty=2.0, frequency_penalty=2.0)
    p2, p3 = exact_marginals(target, params)
    counts = sample_marginals(kit, target, draft, params, 1500)
    assert chi_square(counts[0], p2) + chi_square(counts[1], p3) > 2 * CHI2_CRITICAL_DF7


def demo_pair() -> tuple[Path, Path] | None:
    from serving.demo import draft_path, target_path

    pair = (target_path(), draft_path())
    return pair if all((p / "model.safetensors").is_file() for p in pair) else None


@pytest.mark.skipif(demo_pair() is None, reason="demo target/draft weights not present")
def test_demo_pair_greedy_output_is_identical_and_the_draft_is_accepted(kit: Any) -> None:
    pair = demo_pair()
    assert pair is not None
    target, draft = pair
    texts = ["import os\nimport sys\n\n\ndef main(argv):\n", "class Stack:\n    def __init__(self):\n"]
    engine_off = kit.make_engine(target)
    prompts = [engine_off.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)] * len(prompts)
    expected = kit.run_to_completion(engine_off, prompts, params)
    engine = spec_engine(kit, target, method="draft", draft_model=str(draft), num_draft_tokens=6)
    assert kit.run_to_completion(engine, prompts, params) == expected
    assert engine.stats().spec.acceptance_rate > 0.3
