"""A draft's catch-up and greedy drafts as one compiled graph (serving.engine.spec.rollout,
`speculative.draft_rollout`)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from serving.engine.config import SpeculativeConfig
from serving.engine.engine import LLMEngine
from serving.engine.spec import rollout as rollout_module
from serving.engine.spec.draft import DraftModelProposer
from serving.engine.spec.rollout import DraftRollout, prepare, unsupported_reason
from serving.engine.types import GenerationRequest, SamplingParams

needs_compiler = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                                    reason="inductor needs a C++ compiler on CPU")


@pytest.fixture(scope="module")
def small_draft_dir(kit: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller random model than the target: many of its drafts are rejected (sequences lag by one)."""
    return kit.save_tiny_model(tmp_path_factory.mktemp("draft"), "llama", num_hidden_layers=1, hidden_size=32,
                               intermediate_size=48)


def engine_with(kit: Any, target: Path, draft: Path, rollout: str = "on", **overrides: Any) -> LLMEngine:
    spec = SpeculativeConfig(enabled=True, method="draft", draft_model=str(draft), num_draft_tokens=3,
                             adaptive=False, draft_rollout=rollout)
    return kit.make_engine(target, speculative=spec, **overrides)


def proposer_of(engine: LLMEngine) -> DraftModelProposer:
    assert engine.speculator is not None and isinstance(engine.speculator.proposer, DraftModelProposer)
    return engine.speculator.proposer


def assert_all_free(engine: LLMEngine) -> None:
    proposer = proposer_of(engine)
    assert engine.blocks.num_used == 0 and proposer.blocks.num_used == 0 and not proposer.computed


@pytest.fixture(scope="module")
def same_draft_engine(kit: Any, llama_dir: Path) -> LLMEngine:
    """The target drafting for itself, rolled out: every draft should be accepted."""
    return engine_with(kit, llama_dir, llama_dir)


# ---- the graph itself ---------------------------------------------------------------------------------

def reference_steps(kit: Any, model_dir: Path, prompts: list[list[int]], lags: list[int], steps: int
                    ) -> tuple[Any, list[list[int]], list[int]]:
    """Each sequence through the model's own paged forward: its first len - lag tokens prefilled, then one token
    per forward, the sequence's own while it has them, then each argmax fed back. Returns the runner (its cache
    holds the K/V), every step's argmax per sequence and the context lengths."""
    runner = kit.PagedRunner(model_dir)
    seqs = [list(p) for p in prompts]
    ctx = [len(p) - lag for p, lag in zip(prompts, lags, strict=True)]
    for i in range(len(seqs)):
        runner.step(seqs, [(i, 0, ctx[i])])
    argmax: list[list[int]] = [[] for _ in seqs]
    for j in range(steps):
        for i in range(len(seqs)):
            argmax[i].append(int(runner.step(seqs, [(i, ctx[i] + j, 1)])[0].argmax()))
            if j + 1 >= lags[i]:  # past its own tokens: the argmax is fed next
                seqs[i] = seqs[i][: ctx[i] + j + 1] + [argmax[i][-1]]
    return runner, argmax, ctx


def rollout_inputs(runner: Any, prompts: list[list[int]], lags: list[int], ctx: list[int], steps: int
                   ) -> tuple[torch.Tensor, ...]:
    """What the proposer passes: forced tokens, lags, positions, the contexts gathered and padded, lengths."""
    bs = runner.cache.block_size
    width = -(-max(ctx) // bs)
    tables = [runner.blocks.block_table(str(i))[:width] for i in range(len(prompts))]
    flat = torch.tensor([b for t in tables for b in t + [0] * (width - len(t))])
    shape = (runner.cache.k.shape[0], len(prompts), width * bs, runner.cache.n_kv_heads, runner.cache.head_dim)
    forced = [[prompts[i][ctx[i] + j] if j < lags[i] else 0 for i in range(len(prompts))] for j in range(steps)]
    k_ctx, v_ctx = (c.index_select(1, flat).view(shape) for c in (runner.cache.k, runner.cache.v))
    return torch.tensor(forced), torch.tensor(lags), torch.tensor(ctx), k_ctx, v_ctx, torch.tensor(ctx)


def reference_kv(runner: Any, ctx: list[int], steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[steps, L, G, Hkv, D] K and V the reference wrote at positions ctx .. ctx + steps - 1."""
    bs = runner.cache.block_size
    ks, vs = [], []
    for j in range(steps):
        slots = [runner.blocks.block_table(str(i))[(c + j) // bs] * bs + (c + j) % bs for i, c in enumerate(ctx)]
        index = torch.tensor(slots)
        ks.append(runner.cache.k.flatten(1, 2).index_select(1, index))
        vs.append(runner.cache.v.flatten(1, 2).index_select(1, index))
    return torch.stack(ks), torch.stack(vs)


@torch.inference_mode()
def test_the_rollout_graph_is_the_model_step_by_step(kit: Any, llama_dir: Path) -> None:
    """rollout_graph (eager) against the model's own paged forward one token at a time: two sequences of
    different context lengths padded into one batch, one lagging by one token and one by two."""
    prompts, lags = kit.random_prompts([7, 35], seed=3), [1, 2]
    rollout = DraftRollout(kit.PagedRunner(llama_dir).model, num_draft_tokens=4)
    runner, expected, ctx = reference_steps(kit, llama_dir, prompts, lags, rollout.steps)
    rollout.model = runner.model
    tokens, k_new, v_new = rollout.eager(rollout_inputs(runner, prompts, lags, ctx, rollout.steps))
    assert tokens.t().tolist() == expected
    k_ref, v_ref = reference_kv(runner, ctx, rollout.steps)
    torch.testing.assert_close(k_new, k_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_new, v_ref, atol=1e-5, rtol=1e-5)


@needs_compiler
# the C++ wrapper's first compile takes ~20-40 s more: the slow tier; the Python one stays in `make test`
@pytest.mark.parametrize("wrapper", ["python", pytest.param("cpp", marks=pytest.mark.slow)])
@torch.inference_mode()
def test_the_compiled_graph_equals_the_model_for_any_context_length_without_recompiling(
    kit: Any, llama_dir: Path, wrapper: str
) -> None:
    """With either of inductor's wrappers (speculative.draft_rollout_wrapper) calling the compiled kernels."""
    model = kit.PagedRunner(llama_dir).model
    rollout = DraftRollout(model, num_draft_tokens=3, wrapper=wrapper)  # type: ignore[arg-type]
    rollout.compile()
    for lengths, lags in (([9], [1]), ([40], [2]), ([18], [2]), ([70], [1])):
        prompts = kit.random_prompts(lengths, seed=len(lengths))
        runner, expected, ctx = reference_steps(kit, llama_dir, prompts, lags, rollout.steps)
        inputs = rollout_inputs(runner, prompts, lags, ctx, rollout.steps)
        tokens, k_new, v_new = rollout(inputs)  # under fail_on_recompile: raises if it would compile
        assert tokens.t().tolist() == expected
        k_ref, v_ref = reference_kv(runner, ctx, rollout.steps)
        torch.testing.assert_close(k_new, k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_new, v_ref, atol=1e-5, rtol=1e-5)


# ---- in the engine --------------------------------------------------------------------------------------

@needs_compiler
def test_a_target_drafting_for_itself_through_the_rollout_has_every_draft_accepted(
    kit: Any, llama_dir: Path, same_draft_engine: LLMEngine
) -> None:
    """The draft is the target, so each draft is the target's own greedy token: any error in the rollout's
    positions, masks or stored K/V shows up as a rejection. Full acceptance leaves the sequence lagging by two
    tokens (the last draft and the bonus token), the rollout's catch-up path. One request at a time (the
    rollout serves a single drafting sequence), then several at once: they draft together step by step until
    only the longest is left."""
    engine = same_draft_engine
    prompts = kit.random_prompts([3, 17, 33, 50, 8], seed=21)
    params = [SamplingParams(temperature=0, max_tokens=10 + 6 * i, ignore_eos=True) for i in range(len(prompts))]
    expected = kit.run_to_completion(kit.make_engine(llama_dir), prompts, params)
    alone = [kit.run_to_completion(engine, [p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert alone == expected
    proposer = proposer_of(engine)
    rolled = proposer.rollouts_total
    assert rolled > 0
    assert kit.run_to_completion(engine, prompts, params) == expected
    assert proposer.rollouts_total > rolled  # the longest request, alone at the end
    spec = engine.stats().spec
    decision = engine.runner.draft_rollout
    assert decision is not None and decision.enabled and proposer.rollout is not None
    assert spec.num_accepted_tokens >= 0.97 * spec.num_draft_tokens > 0
    assert_all_free(engine)


@needs_compiler
def test_greedy_outputs_are_identical_with_a_small_draft_rolled_out_under_preemption_and_prefix_sharing(
    kit: Any, llama_dir: Path, small_draft_dir: Path
) -> None:
    """Rejections (sequences lag by one), sampled requests (drafted step by step beside the rollout), requests
    that opt out, a system prompt shared through both prefix caches, and a KV budget small enough to preempt."""
    system = kit.random_prompts([40], seed=4)[0]
    prompts = [system + p for p in kit.random_prompts([3 + 4 * i for i in range(9)], seed=8)]
    # different lengths, so that the longest (greedy) request drafts alone at the end
    params = [SamplingParams(temperature=0.8 if i % 4 == 3 else 0.0, seed=i, max_tokens=12 + 3 * i,
                             ignore_eos=True, speculative=i % 5 != 4) for i in range(len(prompts))]
    probe = kit.make_engine(llama_dir)
    block = probe.runner.cache.k[:, 0].numel() * 2 * probe.runner.cache.k.element_size()
    expected = kit.run_to_completion(kit.make_engine(llama_dir), prompts, params)
    engine = engine_with(kit, llama_dir, small_draft_dir, kv_cache_bytes=24 * block, max_batched_tokens=64)
    got = kit.run_to_completion(engine, prompts, params)
    assert [g for g, p in zip(got, params, strict=True) if p.greedy] == [
        e for e, p in zip(expected, params, strict=True) if p.greedy]
    assert [len(g) for g in got] == [p.max_tokens for p in params]
    proposer = proposer_of(engine)
    assert proposer.rollouts_total > 0 and proposer.prefix_hit_tokens_total > 0
    assert engine.stats().preemptions_total > 0
    assert_all_free(engine)


@needs_compiler
def test_aborting_mid_rollout_run_frees_every_block(kit: Any, llama_dir: Path,
                                                    same_draft_engine: LLMEngine) -> None:
    engine = same_draft_engine
    (prompt,) = kit.random_prompts([20], seed=2)
    engine.add_request(GenerationRequest("abort", prompt, SamplingParams(temperature=0, max_tokens=100,
                                                                          ignore_eos=True)))
    rolled = proposer_of(engine).rollouts_total
    for _ in range(5):
        engine.step()
    assert proposer_of(engine).rollouts_total > rolled and proposer_of(engine).blocks.num_used > 0
    engine.abort_request("abort")
    assert_all_free(engine)


def test_a_call_the_graphs_refuse_turns_the_rollout_off_and_drafting_goes_on_step_by_step(
    kit: Any, llama_dir: Path, small_draft_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = engine_with(kit, llama_dir, small_draft_dir, rollout="off")
    proposer = proposer_of(engine)
    calls = []

    class Refusing(DraftRollout):
        def __call__(self, inputs: Any) -> Any:
            calls.append(inputs)
            raise RuntimeError("Detected recompile when torch.compile stance is 'fail_on_recompile'")

    proposer.rollout = Refusing(proposer.model, 3)
    proposer.rollout.rollout_cost.intercept = proposer.rollout.rollout_cost.slope = 0.0  # always looks worth it
    prompts = kit.random_prompts([6], seed=9)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    with caplog.at_level(logging.WARNING, logger="serving.engine.spec.draft"):
        got = kit.run_to_completion(engine, prompts, params)
    assert got == kit.run_to_completion(kit.make_engine(llama_dir), prompts, params)
    assert len(calls) == 1 and proposer.rollout is None and proposer.rollouts_total == 0
    assert "draft rollout refused a call" in caplog.text
    assert engine.stats().spec.num_draft_tokens > 0
    assert_all_free(engine)


# ---- when it is used ------------------------------------------------------------------------------------

def test_a_rollout_is_used_only_where_it_costs_less_than_the_forwards_it_replaces(kit: Any, llama_dir: Path) -> None:
    rollout = DraftRollout(kit.PagedRunner(llama_dir).model, num_draft_tokens=8)
    rollout.rollout_cost.intercept = 1.2e-3
    rollout.eager_cost.intercept, rollout.eager_cost.slope = 0.3e-3, 0.02e-3
    assert rollout.pays([1] * 8)  # 1.2 ms against 8 x 0.32 ms
    assert rollout.pays([2] + [1] * 3)  # against 0.34 + 3 x 0.32 ms
    assert not rollout.pays([1] * 3)  # against 3 x 0.32 ms
    rollout.always = True  # speculative.draft_rollout: on
    assert rollout.pays([1])


def test_the_rollout_does_not_apply_where_it_cannot(kit: Any, llama_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from serving.engine.kernels.cpu_linear import pack

    model = kit.PagedRunner(llama_dir).model
    if any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        assert unsupported_reason(model, 4) is None
    assert "num_draft_tokens is 1" in (unsupported_reason(model, 1) or "")
    model.quantization = "int8"
    assert "quantized" in (unsupported_reason(model, 4) or "")
    model.quantization = "none"
    monkeypatch.setattr(rollout_module.shutil, "which", lambda name: None)
    assert "C++ compiler" in (unsupported_reason(model, 4) or "")
    monkeypatch.undo()
    pack(model)
    assert "packed" in (unsupported_reason(model, 4) or "")
    rollout, decision = prepare(model, "on", 4)
    assert rollout is None and not decision.enabled and "packed" in decision.reason
    rollout, decision = prepare(kit.PagedRunner(llama_dir).model, "off", 4)
    assert rollout is None and not decision.enabled and decision.reason == "speculative.draft_rollout is off"


@pytest.mark.parametrize("rollout_ms, kept", [(1.0, True), (1.96, False)])
def test_auto_keeps_the_rollout_only_where_the_start_up_measurement_finds_it_faster(
    kit: Any, llama_dir: Path, monkeypatch: pytest.MonkeyPatch, rollout_ms: float, kept: bool
) -> None:
    monkeypatch.setattr(rollout_module, "unsupported_reason", lambda model, k: None)
    monkeypatch.setattr(DraftRollout, "compile", lambda self: 0.5)
    monkeypatch.setattr(DraftRollout, "measure", lambda self: (rollout_ms * 1e-3, 2.0e-3))
    rollout, decision = prepare(kit.PagedRunner(llama_dir).model, "auto", 4)
    assert decision.enabled is kept and (rollout is not None) is kept
    assert decision.rollout_ms == pytest.approx(rollout_ms) and decision.eager_ms == pytest.approx(2.0)
    assert decision.compile_s == 0.5 and decision.steps == 5


def test_a_failed_compile_is_refused_by_name_when_on_and_reported_when_auto(
    kit: Any, llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: DraftRollout) -> float:
        raise RuntimeError("C++ compile error: cc1plus killed")

    monkeypatch.setattr(rollout_module, "unsupported_reason", lambda model, k: None)
    monkeypatch.setattr(DraftRollout, "compile", broken)
    model = kit.PagedRunner(llama_dir).model
    with pytest.raises(RuntimeError, match="speculative.draft_rollout is on"):
        prepare(model, "on", 4)
    rollout, decision = prepare(model, "auto", 4)
    assert rollout is None and not decision.enabled and "cc1plus killed" in decision.reason
    assert "cpp wrapper" in decision.reason and "python wrapper" in decision.reason  # both were tried


@pytest.mark.parametrize("wrapper, cpp", [("cpp", True), ("python", False)])
def test_the_wrapper_setting_is_inductors_cpp_wrapper_option(kit: Any, llama_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch, wrapper: str,
                                                              cpp: bool) -> None:
    """The graph-equals-the-model test passes with either wrapper, so it cannot tell whether the setting reached
    inductor: this checks what torch.compile is asked for."""
    asked: list[dict[str, Any]] = []
    def compile_(fn: Any, **kwargs: Any) -> Any:
        asked.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", compile_)
    DraftRollout(kit.PagedRunner(llama_dir).model, num_draft_tokens=3, wrapper=wrapper)  # type: ignore[arg-type]
    assert asked == [{"fullgraph": True, "options": {"cpp_wrapper": cpp}}]


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_a_failed_cpp_wrapper_falls_back_to_the_python_wrapper_and_says_so(
    kit: Any, llama_dir: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    def cpp_fails(self: DraftRollout) -> float:
        if self.wrapper == "cpp":
            raise RuntimeError("cpp_wrapper: undefined reference")
        return 0.5

    monkeypatch.setattr(rollout_module, "unsupported_reason", lambda model, k: None)
    monkeypatch.setattr(DraftRollout, "compile", cpp_fails)
    monkeypatch.setattr(DraftRollout, "measure", lambda self: (1e-3, 2e-3))
    rollout, decision = prepare(kit.PagedRunner(llama_dir).model, mode, 4, "cpp")  # type: ignore[arg-type]
    assert rollout is not None and rollout.wrapper == "python" and decision.wrapper == "python"
    assert decision.enabled and "python wrapper" in decision.reason and "undefined reference" in decision.reason


@needs_compiler
def test_the_adaptive_policy_is_told_a_lone_sequences_drafts_cost_one_rollout(
    kit: Any, llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = SpeculativeConfig(enabled=True, method="draft", draft_model=str(llama_dir), num_draft_tokens=3,
                             adaptive=True, draft_rollout="on")
    engine = kit.make_engine(llama_dir, speculative=spec)
    assert engine.speculator is not None
    policy = engine.speculator.policy
    flats: list[float | None] = []
    choose = policy.choose

    def recording(*args: Any, **kwargs: Any) -> dict[str, int]:
        flats.append(args[3] if len(args) > 3 else kwargs.get("flat_draft_seconds"))
        return choose(*args, **kwargs)

    monkeypatch.setattr(policy, "choose", recording)
    prompts = kit.random_prompts([12], seed=13)
    greedy = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    assert kit.run_to_completion(engine, prompts, greedy) == kit.run_to_completion(kit.make_engine(llama_dir),
                                                                                   prompts, greedy)
    proposer = proposer_of(engine)
    assert proposer.rollout is not None and proposer.rollouts_total > 0
    assert any(f is not None and f > 0 for f in flats)  # the rollout's fitted cost, as it stood at each step
    flats.clear()
    kit.run_to_completion(engine, prompts, [SamplingParams(temperature=0.8, seed=1, max_tokens=10)])
    assert flats and all(f is None for f in flats)  # sampled: drafted step by step, priced per forward
    assert_all_free(engine)


@needs_compiler
def test_a_rolled_out_draft_keeps_plain_weights_and_the_target_is_still_packed(kit: Any, llama_dir: Path) -> None:
    """The rollout is prepared before packing: its graph needs plain weights and pays far more than packing a
    small draft, whose packed and plain steps often measure alike (a coin flip under `auto`)."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    spec = SpeculativeConfig(enabled=True, method="draft", draft_model=str(llama_dir), num_draft_tokens=3,
                             draft_rollout="on")
    engine = kit.make_engine(llama_dir, speculative=spec, cpu_weight_packing="on")
    target, draft = engine.runner.weight_packing
    assert target.packed and not draft.packed and "rollout" in draft.reason
    assert proposer_of(engine).rollout is not None
    prompts = kit.random_prompts([10], seed=17)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    assert kit.run_to_completion(engine, prompts, params) == kit.run_to_completion(
        kit.make_engine(llama_dir, cpu_weight_packing="on"), prompts, params)
    assert proposer_of(engine).rollouts_total > 0
