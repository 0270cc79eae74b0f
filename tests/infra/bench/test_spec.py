from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from infra.bench.spec import (
    alpha_per_position,
    draft_agreement,
    expected_speedup,
    tokens_per_round,
)
from serving.engine.types import SamplingParams


def test_alpha_is_one_for_a_draft_equal_to_the_target_and_lower_for_another(
    kit: Any, llama_dir: Path, qwen2_dir: Path
) -> None:
    engine = kit.make_engine(llama_dir)
    prompts = kit.random_prompts([12, 30, 7], seed=3)
    outputs = kit.run_to_completion(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=16,
                                                                     ignore_eos=True)] * 3)
    same = [draft_agreement(engine.model, p, o) for p, o in zip(prompts, outputs, strict=True)]
    assert all(all(agree) for agree in same) and alpha_per_position(same, 4) == [1.0] * 4
    other = kit.make_engine(qwen2_dir).model  # same vocabulary, different weights
    alpha = alpha_per_position([draft_agreement(other, p, o) for p, o in zip(prompts, outputs, strict=True)], 4)
    assert len(alpha) == 4 and all(0.0 <= a <= 1.0 for a in alpha) and alpha[0] < 0.5


def test_expected_speedup_is_tokens_a_round_over_the_cost_of_a_round() -> None:
    # decode steps of 1 s; a round: a verify of 1.5 s and the drafting (k eager steps or one rollout) of 0.5 s
    ceiling = {"target_decode_step_s": 1.0, "target_verify_step_s": 1.5, "drafting_s": 0.5}
    assert expected_speedup(1.75, ceiling) == pytest.approx(1.75 / 2.0)
    assert expected_speedup(3.0, {**ceiling, "drafting_s": 0.1}) == pytest.approx(3 / 1.6)


@pytest.mark.slow
def test_the_spec_bench_without_the_policy_drafts_k_and_splits_the_c1_step() -> None:
    """`bench spec --no-adaptive` on the demo pair, shortened: every c=1 speculating step drafts k (short only
    where a request's remaining tokens cap it), and the report splits a c=1 step of spec off and of draft. The
    draft rollout is on: the demo draft's drafts come from the compiled rollout, and outputs stay identical."""
    from infra.bench.spec import run_spec_benchmark
    from serving.demo import draft_path, target_path

    trace: list[dict[str, Any]] = []
    report = run_spec_benchmark(target_path(), draft_path(), [1, 2], output_len=24, num_prompts=2, k=4, threads=1,
                                baselines=False, repeats=1, adaptive=False, draft_rollout="on", policy_trace=trace)
    assert report.adaptive is False and report.greedy_identical
    # --trace-policy: every choice of both speculating engines, labelled with the bench phase it was made in
    phases = ("warm-up", "c1-latency", "throughput-c1", "throughput-c2")
    assert {(r["system"], r["phase"]) for r in trace} == {(s, p) for s in ("draft", "ngram") for p in phases} | {
        ("draft", "c1-profile")}  # the step split profiles spec off and the draft engine
    assert all(sum(r["k"].values()) == r["candidates"] for r in trace)
    assert report.draft_rollout is not None and report.draft_rollout["enabled"] and report.draft_rollouts > 0
    hist = report.c1_draft_k_histogram
    c1_draft = [r for r in trace if r["system"] == "draft" and r["phase"] == "c1-latency"]
    assert sum(r["k"].get(4, 0) for r in c1_draft) == hist[4]  # the trace saw every c=1 choice the report counts
    assert max(hist) == 4 and sum(v for k, v in hist.items() if k != 4) <= 2, hist  # one capped step a request
    ceiling = report.ceiling  # drafting priced as the c=1 path drafts: one rollout, not k eager steps
    assert ceiling["drafting_s"] == ceiling["draft_rollout_s"] > 0
    assert ceiling["draft_ceiling_speedup"] == pytest.approx(
        5 * ceiling["target_decode_step_s"] / (ceiling["target_verify_step_s"] + ceiling["drafting_s"]))
    off, draft = report.c1_step_split["spec_off"], report.c1_step_split["spec_draft"]
    assert off["steps"] >= 2 * 24 and off["drafting_ms"] == 0.0
    assert 0 < draft["steps"] < off["steps"] and draft["drafting_ms"] > 0.0


def test_interleaved_c1_runs_every_prompt_on_every_engine_back_to_back(kit: Any, llama_dir: Path) -> None:
    """The c=1 comparison alternates systems prompt by prompt (order rotating), so drift hits all of them."""
    from infra.bench.spec import run_interleaved

    engines = {"a": kit.make_engine(llama_dir), "b": kit.make_engine(llama_dir)}
    order: list[str] = []
    for name, engine in engines.items():
        add = engine.add_request

        def recording(request: Any, _add: Any = add, _name: str = name) -> None:
            order.append(f"{_name}:{request.request_id}")
            _add(request)

        engine.add_request = recording  # type: ignore[method-assign]
    prompts = kit.random_prompts([9, 14, 5], seed=4)
    runs, outputs, paired = run_interleaved(engines, prompts, output_len=6, rounds=2)

    # round r, prompt i: both systems, starting with the one the rotation picks
    assert order[:4] == ["a:a-0-0", "b:b-0-0", "b:b-0-1", "a:a-0-1"]
    assert len(order) == 2 * 3 * 2
    assert [r.system for r in runs] == ["a", "b"]
    assert all(r.requests == 6 and r.output_tokens == 36 for r in runs)
    assert outputs["a"] == outputs["b"] and [len(o) for o in outputs["a"]] == [6] * 6  # both rounds, prompt by prompt
    assert outputs["a"][:3] == outputs["a"][3:]
    assert len(paired) == 6 and all(p > 0 for p in paired)


def test_the_c1_report_per_prompt_says_which_prompts_are_slow_and_how_long_their_rounds_were(
    kit: Any, llama_dir: Path, qwen2_dir: Path
) -> None:
    """Per prompt: the median latency of every system and the tokens per verification of each speculating one.
    A draft equal to the target has every draft accepted, so its rounds are k + 1 tokens but where a request's
    remaining tokens cap k; a draft with other weights has much shorter rounds, on every prompt."""
    from infra.bench.spec import PromptLatency, SpecBenchReport, run_interleaved
    from serving.engine.config import SpeculativeConfig

    def drafting(draft: Path) -> Any:
        return kit.make_engine(llama_dir, speculative=SpeculativeConfig(
            enabled=True, method="draft", draft_model=str(draft), num_draft_tokens=3, adaptive=False))

    engines = {"spec_off": kit.make_engine(llama_dir), "spec_draft": drafting(llama_dir),
               "spec_ngram": drafting(qwen2_dir)}  # an unrelated draft, under another system's name
    prompts = kit.random_prompts([9, 14, 5], seed=4)
    per_prompt: list[PromptLatency] = []
    runs, outputs, _ = run_interleaved(engines, prompts, output_len=13, rounds=2, per_prompt=per_prompt)
    assert outputs["spec_off"] == outputs["spec_draft"] == outputs["spec_ngram"]
    assert [(p.prompt, p.prompt_tokens) for p in per_prompt] == [(0, 9), (1, 14), (2, 5)]
    assert all(set(p.seconds) == set(engines) and min(p.seconds.values()) > 0 for p in per_prompt)
    # 13 tokens: the prefill's token, then 3 full rounds of 4 tokens
    assert all(p.tokens_per_round["spec_draft"] == 4.0 for p in per_prompt)
    assert all(p.tokens_per_round["spec_ngram"] < 3.0 for p in per_prompt)
    assert "spec_off" not in per_prompt[0].tokens_per_round  # no verifications
    assert per_prompt[0].draft_speedup == per_prompt[0].seconds["spec_off"] / per_prompt[0].seconds["spec_draft"]
    # the run's mean accepted length is the per-prompt rounds together (each prompt ran the same number of times)
    draft_run = next(r for r in runs if r.system == "spec_draft")
    assert draft_run.mean_accepted_length == 4.0
    report = SpecBenchReport("t", "d", 1, 3, len(prompts), 13, c1_prompts=per_prompt)
    rows = report.to_dict()["c1_prompts"]
    assert [row["draft_speedup"] for row in rows] == [p.draft_speedup for p in per_prompt]


def test_the_c1_report_per_prompt_attributes_each_request_to_its_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stub engines whose latency and verifications depend on the prompt and the pass: each prompt's row holds the
    median of its own requests and the round length of its own verifications, and the run's counts are their
    sums."""
    from types import SimpleNamespace

    from infra.bench import spec as benchmark

    class Stub:
        def __init__(self) -> None:
            self.spec = SimpleNamespace(num_draft_tokens=0, num_accepted_tokens=0, num_drafts=0)

        def stats(self) -> Any:
            return SimpleNamespace(spec=self.spec)

    def run_one(engine: Stub, request_id: str, prompt: list[int], output_len: int) -> tuple[float, list[int]]:
        system, r, i = request_id.rsplit("-", 2)
        if system == "draft":  # prompt i: i + 1 verifications of 4 drafts, 3 - i of them accepted each time
            engine.spec.num_drafts += int(i) + 1
            engine.spec.num_draft_tokens += 4 * (int(i) + 1)
            engine.spec.num_accepted_tokens += (3 - int(i)) * (int(i) + 1)
        return 0.1 * (int(i) + 1) + 0.01 * int(r) ** 2 * (1 if system == "off" else 2), [0] * output_len

    monkeypatch.setattr(benchmark, "run_one", run_one)
    per_prompt: list[benchmark.PromptLatency] = []
    runs, _, _ = benchmark.run_interleaved({"off": Stub(), "draft": Stub()}, [[1], [1, 2], [1, 2, 3]], 5, 3,
                                           per_prompt)
    assert [p.seconds for p in per_prompt] == [
        {"off": pytest.approx(0.1 * (i + 1) + 0.01), "draft": pytest.approx(0.1 * (i + 1) + 0.02)} for i in range(3)]
    assert [p.tokens_per_round for p in per_prompt] == [{"draft": 4.0 - i} for i in range(3)]
    assert [p.prompt_tokens for p in per_prompt] == [1, 2, 3]
    off, draft = runs
    assert off.mean_accepted_length is None and off.acceptance_rate is None
    # over the run: 3 x (1 + 2 + 3) verifications of 4 drafts, 3 x (3 + 4 + 3) accepted
    assert draft.mean_accepted_length == pytest.approx((30 + 18) / 18)
    assert draft.acceptance_rate == pytest.approx(30 / 72)


def test_tokens_per_round_replays_greedy_speculation_over_the_outputs() -> None:
    T, F = True, False
    # out[0] comes from the prefill; rounds of k = 3 start at 1: [1, 2, 3] accepted + 1 -> 4 tokens (1..4); at 5:
    # rejected at once -> 1 token; at 6: 1 accepted (6), 7 rejected -> 2 tokens (6, 7); the last token (8) alone is
    # a plain decode step, no round
    agree = [F, T, T, T, F, F, T, F, T]
    assert tokens_per_round([agree], 3) == pytest.approx((4 + 1 + 2) / 3)
    assert tokens_per_round([[T] * 9], 3) == pytest.approx(8 / 2)  # 1..4, then 5..8: never past the end
    assert tokens_per_round([[T] * 9], 12) == pytest.approx(8 / 1)
    # rounds start after rejections: below what a round starting at every t (alpha per position) predicts
    clustered = [F] + [T] * 8 + [F, F, F, T, F, F, T] * 4
    alpha = alpha_per_position([clustered], 4)
    predicted, reach = 1.0, 1.0
    for a in alpha:
        reach *= a
        predicted += reach
    assert tokens_per_round([clustered], 4) < predicted


@pytest.mark.slow
def test_the_replayed_round_length_is_what_the_engine_does_at_fixed_k() -> None:
    """Greedy, k fixed (no policy), the rollout off: the engine's mean accepted length equals the replay's."""
    from infra.bench.spec import draft_agreement, load_prompts, run_sequential
    from serving.demo import draft_path, target_path
    from serving.engine.config import EngineConfig, SpeculativeConfig
    from serving.engine.engine import LLMEngine

    def engine(spec: SpeculativeConfig) -> LLMEngine:
        return LLMEngine.from_config(EngineConfig(model=str(target_path()), device="cpu", kv_cache_bytes=32 * 2**20,
                                                  num_threads=1, speculative=spec))

    off = engine(SpeculativeConfig(enabled=False))
    prompts = load_prompts(off.tokenizer, 3)
    outputs: list[list[int]] = []
    run_sequential(off, "off", prompts, 40, outputs)
    on = engine(SpeculativeConfig(enabled=True, method="draft", draft_model=str(draft_path()), num_draft_tokens=4,
                                  adaptive=False, draft_rollout="off"))
    run = run_sequential(on, "draft", prompts, 40)
    draft = on.speculator.proposer.model  # type: ignore[union-attr]
    replayed = tokens_per_round([draft_agreement(draft, p, o) for p, o in zip(prompts, outputs, strict=True)], 4)
    assert run.mean_accepted_length == pytest.approx(replayed)
