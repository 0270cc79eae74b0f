"""Compiled small steps: bucketing, the config switch, and greedy tokens identical to the eager engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from serving.engine.compile import BUCKETS, attention_op, buckets_up_to
from serving.engine.types import SamplingParams


def test_buckets_cover_the_largest_step_with_one_bucket_to_spare() -> None:
    assert buckets_up_to(1) == [1]
    assert buckets_up_to(5) == [1, 2, 4, 8]
    assert buckets_up_to(32) == [1, 2, 4, 8, 16, 32]
    assert buckets_up_to(10_000) == list(BUCKETS)  # steps above the largest bucket run eagerly


def test_attention_op_outside_a_step_says_so() -> None:
    q = torch.zeros(2, 4, 8)
    with pytest.raises(RuntimeError, match="outside a compiled step"):
        attention_op(q, q[:, :2], q[:, :2], 0)


def test_compile_off_and_auto_on_cpu_run_eagerly(llama_dir: Path, kit: Any) -> None:
    for mode in ("off", "auto"):
        engine = kit.make_engine(llama_dir, compile=mode)
        assert engine.runner.compiled is None
        prompts = kit.random_prompts([5, 9])
        assert all(len(t) == 3 for t in kit.run_to_completion(
            engine, prompts, [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)] * 2))


@pytest.mark.slow
def test_compiled_steps_give_the_eager_greedy_tokens(llama_dir: Path, kit: Any) -> None:
    # four sequences at most: buckets 1, 2 and 4 (three decoding sequences pad to 4)
    settings = {"max_concurrency": 4, "max_batched_tokens": 16, "compile": "off"}
    prompts = kit.random_prompts([3, 11, 6, 20], seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 5, 9, 16)]
    eager = kit.run_to_completion(kit.make_engine(llama_dir, **settings), prompts, params)

    engine = kit.make_engine(llama_dir, **settings)
    engine.runner.compile_steps(measure=False)  # every bucket compiled, whether or not it pays here
    assert engine.runner.compiled is not None
    assert sorted(engine.runner.compiled.graphs) == [1, 2, 4]
    compiled = kit.run_to_completion(engine, prompts, params)
    assert engine.runner.compiled.steps_compiled > 10
    assert sorted(engine.runner.compiled.graphs) == [1, 2, 4]  # no bucket needed a compile while serving
    assert compiled == eager
    assert engine.blocks.num_used == 0


def test_a_step_goes_to_the_smallest_bucket_that_holds_it(llama_dir: Path, kit: Any) -> None:
    from serving.engine.compile import CompiledForward

    runner = kit.PagedRunner(llama_dir)
    compiled = CompiledForward(runner.model, [4, 1, 2])
    assert [compiled.bucket_for(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]  # 5 tokens: eager
    assert not compiled.cuda_graphs  # CUDA graphs only on a CUDA device


def test_whole_decode_needs_the_paged_attention_path(llama_dir: Path, kit: Any) -> None:
    from serving.engine.compile import CompiledForward

    runner = kit.PagedRunner(llama_dir)
    with pytest.raises(ValueError, match="paged attention"):
        CompiledForward(runner.model, [1, 2], whole_decode=True)
    assert not CompiledForward(runner.model, [1, 2]).whole_decode  # off by default on CPU


def test_a_decode_step_without_writing_the_cache_equals_the_step_that_writes_it(llama_dir: Path, kit: Any) -> None:
    """forward_decode (the graph of a decode step captured whole) reads the cache and returns the new K/V; stored
    afterwards, they equal what the eager step wrote, and so do the logits. Rows: a sequence whose new token starts
    a block, one mid-block, one that shares another's blocks (prefix caching), a one-token prompt (no context)."""
    from serving.engine.batch import SequenceInput, build_forward_batch
    from serving.engine.compile import fill_decode_inputs

    runner = kit.PagedRunner(llama_dir)
    model, cache, blocks = runner.model, runner.cache, runner.blocks
    prompts = kit.random_prompts([32, 21, 40], seed=5)
    with torch.inference_mode():
        for sid, n in ((0, 32), (1, 21)):  # prefill what the decode rows read
            runner.step(prompts, [(sid, 0, n)])
        blocks.allocate("0", 33)
        blocks.allocate("1", 22)
        blocks.allocate("3", 1)
        blocks.allocate("2", 33)
        shared = blocks.block_table("0")[:2] + blocks.block_table("2")[2:3]  # two of 0's blocks, then its own
        seqs = [SequenceInput([prompts[0][0]], 32, blocks.block_table("0"), [0]),
                SequenceInput([prompts[1][5]], 21, blocks.block_table("1"), [0]),
                SequenceInput([prompts[2][7]], 32, shared, [0]),
                SequenceInput([prompts[2][0]], 0, blocks.block_table("3"), [0])]
        batch = build_forward_batch(seqs, 16, model.args.n_rep, runner.device)
        model.set_paged_attention(True)
        before_k, before_v = cache.k.clone(), cache.v.clone()
        # bucket 8's static inputs as an earlier step left them: the four padding rows and the table entries past
        # each real row's context keep stale (valid) values, which must change nothing in the real rows
        gen = torch.Generator().manual_seed(3)
        ids = torch.randint(0, model.args.vocab_size, (8,), generator=gen)
        positions = torch.randint(0, 100, (8,), generator=gen)
        tables = torch.randint(0, cache.num_blocks, (8, 512 // 16), generator=gen).int()
        ctx_lens = torch.randint(0, 100, (8,), generator=gen)
        stale = ids.clone(), tables.clone(), ctx_lens.clone()
        assert fill_decode_inputs(batch, ids, positions, tables, ctx_lens) == 4
        assert sorted(ctx_lens[:4].tolist()) == [0, 21, 32, 32]
        assert torch.equal(ids[4:], stale[0][4:]) and torch.equal(tables[4:], stale[1][4:])  # padding untouched
        assert torch.equal(tables[:, 3:], stale[1][:, 3:])  # past the widest real table (3 blocks): untouched
        hidden, new_k, new_v = model.forward_decode(ids, positions, tables, ctx_lens, cache)
        assert torch.equal(cache.k, before_k) and torch.equal(cache.v, before_v)  # nothing written
        cache.write_layers(batch.slot_mapping, new_k[:, :4], new_v[:, :4])
        captured = model.compute_logits(hidden[:4], batch.logits_index)
        after_k = cache.k.clone()
        model.set_paged_attention(False)
        cache.k.copy_(before_k)
        cache.v.copy_(before_v)
        eager = model.compute_logits(model(batch, cache), batch.logits_index)
    torch.testing.assert_close(captured, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after_k, cache.k, atol=1e-5, rtol=0)  # layer 1 K: rounding of layer 0


@pytest.mark.slow
def test_decode_steps_captured_whole_give_the_eager_greedy_tokens(llama_dir: Path, kit: Any) -> None:
    """The whole-decode graphs traced by dynamo (fullgraph, the "eager" backend: inductor cannot lower them on
    CPU), run through the engine with mixed prefill, decode and one-token prompts: the gather engine's tokens."""
    settings = {"max_concurrency": 4, "max_batched_tokens": 16, "compile": "off", "kv_block_size": 16}
    prompts = kit.random_prompts([3, 11, 1, 20, 6], seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 5, 9, 16, 30)]
    eager = kit.run_to_completion(kit.make_engine(llama_dir, **settings), prompts, params)

    engine = kit.make_engine(llama_dir, **settings)
    engine.model.set_paged_attention(True)
    engine.runner.compile_steps(measure=False, whole_decode=True, backend="eager")
    compiled = engine.runner.compiled
    assert compiled is not None
    assert sorted(compiled.decode_graphs) == [1, 2, 4]
    assert [d.kind for d in compiled.decisions].count("decode") == 3
    captured = kit.run_to_completion(engine, prompts, params)
    assert compiled.steps_whole_decode > 20
    assert sorted(compiled.decode_graphs) == [1, 2, 4]  # none refused while serving
    assert captured == eager
    assert engine.blocks.num_used == 0


@pytest.mark.slow
def test_speculation_with_paged_attention_keeps_every_graph(llama_dir: Path, kit: Any) -> None:
    """Verify steps run piecewise (FlexAttention compiled per new shape inside the attention op) and plain decode
    steps whole, in one engine: no graph is refused while serving, and greedy outputs stay."""
    from serving.engine.config import SpeculativeConfig

    system = kit.random_prompts([40], seed=11)[0]
    prompts = [system + p for p in kit.random_prompts([5, 9, 2], seed=12)]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * len(prompts)
    settings = {"max_concurrency": 4, "enable_prefix_caching": True, "compile": "off"}
    plain = kit.run_to_completion(kit.make_engine(llama_dir, **settings), prompts, params)
    spec = SpeculativeConfig(enabled=True, method="ngram", adaptive=True, num_draft_tokens=3)
    engine = kit.make_engine(llama_dir, speculative=spec, **settings)
    engine.model.set_paged_attention(True)
    engine.runner.compile_steps(measure=False, whole_decode=True, backend="eager")
    compiled = engine.runner.compiled
    assert compiled is not None
    buckets = sorted(compiled.graphs)
    assert kit.run_to_completion(engine, prompts, params) == plain
    assert sorted(compiled.graphs) == buckets  # before the fix, the first verify step's bucket was dropped
    assert compiled.steps_whole_decode > 0 and compiled.steps_compiled > compiled.steps_whole_decode
    assert engine.stats().spec.num_draft_tokens > 0
    assert engine.blocks.num_used == 0


@pytest.mark.slow
@pytest.mark.parametrize("paged", [False, True], ids=["gather", "paged-whole-decode"])
def test_the_draft_model_steps_run_through_graphs_too(llama_dir: Path, kit: Any, paged: bool) -> None:
    """A draft-speculation engine compiles the draft's small steps beside the target's (traced by dynamo with the
    eager backend); greedy outputs equal the uncompiled engine's, and the draft's steps ran through its graphs."""
    from serving.engine.config import SpeculativeConfig
    from serving.engine.spec.draft import DraftModelProposer

    prompts = kit.random_prompts([7, 30, 1], seed=13)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 12, 16)]
    spec = SpeculativeConfig(enabled=True, method="draft", adaptive=False, num_draft_tokens=3,
                             draft_model=str(llama_dir))
    settings = {"max_concurrency": 4, "compile": "off", "speculative": spec}
    plain = kit.run_to_completion(kit.make_engine(llama_dir, **settings), prompts, params)

    engine = kit.make_engine(llama_dir, **settings)
    proposer = engine.speculator.proposer if engine.speculator is not None else None
    assert isinstance(proposer, DraftModelProposer)
    if paged:
        engine.model.set_paged_attention(True)
        proposer.model.set_paged_attention(True)
    engine.runner.compile_steps(measure=False, whole_decode=paged, backend="eager")
    draft_graphs = proposer.compiled
    assert draft_graphs is not None and sorted(draft_graphs.graphs) == [1, 2, 4]
    assert sorted(draft_graphs.decode_graphs) == ([1, 2, 4] if paged else [])
    assert kit.run_to_completion(engine, prompts, params) == plain
    assert draft_graphs.steps_compiled > 10
    assert (draft_graphs.steps_whole_decode > 5) is paged
    assert sorted(draft_graphs.graphs) == [1, 2, 4]  # none refused while serving
    assert engine.blocks.num_used == 0 and proposer.blocks.num_used == 0


def test_a_target_and_its_draft_stay_under_dynamos_recompile_limit(llama_dir: Path, kit: Any, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bucket of the target and of a draft of another shape recompiles the same code: 12 graphs here,
    beyond dynamo's default limit of 8, past which the draft's larger buckets failed to compile (fullgraph: a hard
    FailOnRecompileLimitHit) and ran eagerly."""
    import serving.engine.compile as compile_module
    from serving.engine.config import SpeculativeConfig

    torch._dynamo.reset()  # a fresh process as far as dynamo can tell: no entries of earlier tests' engines
    monkeypatch.setattr(compile_module, "_buckets_requested", 0)
    draft = kit.save_tiny_model(tmp_path / "draft", num_hidden_layers=1, intermediate_size=48)
    spec = SpeculativeConfig(enabled=True, method="draft", adaptive=False, num_draft_tokens=3,
                             draft_model=str(draft))
    # dynamo's own patch: it restores the setting afterwards (monkeypatch's undo removed it from the config)
    with torch._dynamo.config.patch(recompile_limit=8):
        engine = kit.make_engine(llama_dir, max_concurrency=16, compile="off", speculative=spec)
        engine.runner.compile_steps(measure=False, backend="eager")
        assert torch._dynamo.config.recompile_limit >= 12
    assert engine.runner.compiled is not None and len(engine.runner.compiled.graphs) == 7  # 1 .. 64 tokens
    proposer = engine.speculator.proposer if engine.speculator is not None else None
    assert proposer is not None and len(proposer.compiled.graphs) == 5  # 1 .. 16 rows
    failed = [d.note for d in engine.runner.compiled.decisions + proposer.compiled.decisions if d.note]
    assert failed == []  # was: the draft's 4- to 16-row buckets, FailOnRecompileLimitHit
