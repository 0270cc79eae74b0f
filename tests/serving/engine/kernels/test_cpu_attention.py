"""Decode attention read in place from the paged KV cache on CPU (serving.engine.kernels.cpu_attention,
`model.cpu_decode_attention`)."""

from __future__ import annotations

import os
import platform
import stat
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from serving.engine.kernels import cpu_attention
from serving.engine.kernels.cpu_attention import (
    DecodeAttentionKernel,
    KernelUnavailable,
    build,
    choose,
    unsupported_reason,
)
from serving.engine.model import KERNEL_MAX_QUERY
from serving.engine.types import SamplingParams

pytestmark = pytest.mark.skipif(cpu_attention.find_compiler() is None, reason="no C++ compiler on PATH")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DecodeAttentionKernel]:
    """The kernel as this host builds it, and its portable path (no AVX2 intrinsics) built on purpose."""
    directory = tmp_path_factory.mktemp("kernels")
    return {"native": DecodeAttentionKernel(build(directory)),
            "generic": DecodeAttentionKernel(build(directory, defines=("SPECDEPLOY_GENERIC",)))}


def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
              q_start: torch.Tensor, lens: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Each sequence's context gathered by hand and attended with SDPA, causally: query token j of sequence g
    sees keys 0 .. q_start[g] + j; its tokens at lens[g] and past are padding, zeros. q [G * T, Hq, D] -> [G * T,
    Hq * D]."""
    _, _, hkv, d = k_pool.shape
    num_seqs = len(lens)
    tokens = q.shape[0] // num_seqs
    rows = []
    for g in range(num_seqs):
        n = int(lens[g])
        k = k_pool[tables[g]].reshape(-1, hkv, d)[:n].transpose(0, 1)  # [Hkv, n, D]
        v = v_pool[tables[g]].reshape(-1, hkv, d)[:n].transpose(0, 1)
        for j in range(tokens):
            if int(q_start[g]) + j >= n:
                rows.append(torch.zeros(q.shape[1] * d, dtype=q.dtype))
                continue
            seen = int(q_start[g]) + j + 1
            qj = q[g * tokens + j].reshape(hkv, n_rep, d)
            rows.append(F.scaled_dot_product_attention(qj, k[:, :seen], v[:, :seen]).reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("path", ["native", "generic"])
@pytest.mark.parametrize("head_dim, n_kv_heads, n_rep", [(32, 4, 2), (64, 2, 4), (128, 1, 8), (32, 2, 1), (16, 2, 2),
                                                         (48, 3, 2)])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("tokens", [1, 3, 4, 9, 16])
def test_the_kernel_equals_gathered_sdpa(kernels: dict[str, DecodeAttentionKernel], path: str, head_dim: int,
                                         n_kv_heads: int, n_rep: int, block_size: int, tokens: int) -> None:
    """Lengths from one key to several blocks, partial last blocks, a block shared by two sequences (prefix
    caching), the query rows and block tables strided views of larger tensors (as the engine passes them); with
    several query tokens (verify steps: 3 and fewer take the decode walk, 4 and more the tiled one where the head
    dim is a multiple of 32), causal, one sequence whose last query token is padding and one that decodes beside
    the verifying ones (one real query token, the rest padding: it takes the decode walk, and its padding rows
    come out as zeros)."""
    g = torch.Generator().manual_seed(head_dim * 100 + n_rep * 10 + block_size + tokens)
    num_blocks = 96
    k_pool = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=g)
    v_pool = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=g)
    lens = torch.tensor([3, 7, block_size, 3 * block_size + 5, 70])
    if tokens > 1:  # a verify step's sequence holds at least its query tokens; one holds nothing else
        lens = torch.maximum(lens, torch.tensor(tokens))
    q_start = lens - tokens
    if tokens > 1:
        q_start[2] += 1  # its last query slot is padding (a shorter query in the group)
        q_start[4] = lens[4] - 1  # a decoding sequence padded to the group's query length
    width = 2 + -(-int(lens.max()) // block_size)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width)
    tables[4, 0] = tables[3, 0]  # a prefix block two sequences share
    hq = n_kv_heads * n_rep
    qkv = torch.randn(len(lens) * tokens, hq + 2 * n_kv_heads, head_dim, generator=g)
    q = qkv[:, :hq]  # strided rows, as the engine's q is a slice of the fused qkv projection
    got = kernels[path](q, k_pool, v_pool, tables[:, : width - 1], q_start, lens, n_rep, head_dim**-0.5)
    want = reference(q, k_pool, v_pool, tables, q_start, lens, n_rep)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("path", ["native", "generic"])
@pytest.mark.parametrize("profile", ["rising", "falling", "spike"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_the_online_softmax_holds_when_a_later_block_has_the_largest_scores(
    kernels: dict[str, DecodeAttentionKernel], path: str, profile: str, tokens: int
) -> None:
    """The decode walk keeps each row's maximum and sum as it goes, block by block, and rescales what it has added
    when a later block's scores are larger: keys scaled so that the scores' spread grows along the context (the
    maximum rises block after block), shrinks, or peaks in one middle block. Against SDPA in float64: in fp32 both
    round exponentials of scores this large differently, by more than the tolerance (the previous two-pass kernel
    as much as this one)."""
    g = torch.Generator().manual_seed({"rising": 1, "falling": 2, "spike": 3}[profile] + 10 * tokens)
    block_size, hkv, n_rep, d, length = 16, 2, 4, 32, 150
    blocks = -(-length // block_size)
    q = torch.randn(tokens, hkv * n_rep, d, generator=g)
    k = torch.randn(blocks, block_size, hkv, d, generator=g)
    position = torch.arange(blocks * block_size, dtype=torch.float32).view(blocks, block_size, 1, 1)
    if profile == "rising":
        k = k * (0.2 + position / 40)
    elif profile == "falling":
        k = k * (0.2 + (blocks * block_size - position) / 40)
    else:
        k[blocks // 2] *= 10
    v = torch.randn(blocks, block_size, hkv, d, generator=g)
    tables = torch.randperm(blocks, generator=g).view(1, blocks)
    q_start, lens = torch.tensor([length - tokens]), torch.tensor([length])
    got = kernels[path](q, k, v, tables, q_start, lens, n_rep, d**-0.5)
    want = reference(q.double(), k.double(), v.double(), tables, q_start, lens, n_rep)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6)


def test_a_sequence_of_one_key(kernels: dict[str, DecodeAttentionKernel]) -> None:
    """The first decode step after a one-token prompt: the output is that token's value."""
    pool_k, pool_v = torch.randn(4, 16, 2, 32), torch.randn(4, 16, 2, 32)
    q = torch.randn(1, 4, 32)
    got = kernels["native"](q, pool_k, pool_v, torch.tensor([[2]]), torch.tensor([0]), torch.tensor([1]), 2, 0.2)
    torch.testing.assert_close(got.view(2, 2, 32), pool_v[2, 0][:, None].expand(2, 2, 32))


def test_the_kernel_refuses_an_empty_sequence(kernels: dict[str, DecodeAttentionKernel]) -> None:
    pool = torch.zeros(4, 16, 2, 32)
    q = torch.zeros(2, 4, 32)
    with pytest.raises(ValueError, match="length <= 0"):
        kernels["native"](q, pool, pool, torch.zeros(2, 1, dtype=torch.long), torch.tensor([2, 0]),
                          torch.tensor([3, 0]), 2, 1.0)


def _engine_outputs(kit: Any, model_dir: Path, mode: str, **overrides: Any) -> tuple[list[list[int]], Any]:
    shared = kit.random_prompts([40], seed=21)[0]  # a shared prompt prefix: prefix-cached blocks
    prompts = [shared + p for p in kit.random_prompts([6, 13, 3, 30], seed=22)] + kit.random_prompts([1, 21], seed=23)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(prompts)
    engine = kit.make_engine(model_dir, cpu_decode_attention=mode, **overrides)
    outputs = kit.run_to_completion(engine, prompts, params)
    assert engine.blocks.num_used == 0
    return outputs, engine


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight query heads of 32: the kernel's AVX2 path (the tiny test models have four heads of 16)."""
    from tests.serving.engine.conftest import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("wide"), "llama", hidden_size=256, num_attention_heads=8,
                           num_key_value_heads=4)


@pytest.mark.parametrize("which", ["llama", "wide"])
def test_engines_with_and_without_the_kernel_give_identical_greedy_tokens(
    kit: Any, llama_dir: Path, qwen2_dir: Path, wide_dir: Path, which: str
) -> None:
    """With a draft model (its decode steps attend through the kernel too), prefix caching and a KV budget small
    enough to preempt: the same tokens, every block free at the end."""
    model_dir = {"llama": llama_dir, "wide": wide_dir}[which]
    spec = {"enabled": True, "method": "draft", "draft_model": str(qwen2_dir), "num_draft_tokens": 3}
    settings = {"speculative": spec, "kv_cache_bytes": 96 * 1024 if which == "llama" else 640 * 1024}
    off, off_engine = _engine_outputs(kit, model_dir, "off", **settings)
    on, engine = _engine_outputs(kit, model_dir, "on", **settings)
    assert [(d.model, d.kernel) for d in engine.runner.decode_attention] == [("target", True), ("draft", True)]
    # groups read in place are not split to keep a gathered copy small; gathered ones are
    builders = [(e.runner.builder, e.speculator.proposer.builder) for e in (engine, off_engine)]  # type: ignore[union-attr]
    assert [b.in_place_max_q for pair in builders for b in pair] == [KERNEL_MAX_QUERY] * 2 + [0] * 2
    assert engine.stats().spec.num_draft_tokens > 0
    assert engine.stats().preemptions_total > 0, "the KV budget was meant to force preemption"
    assert on == off
    plain, _ = _engine_outputs(kit, model_dir, "on")  # no speculation: the same tokens again
    assert plain == on


@pytest.mark.parametrize("kernel_ms, kept", [(0.5, True), (0.95, True), (0.99, False)])
def test_auto_keeps_the_kernel_only_where_decode_groups_measure_faster(
    kit: Any, llama_dir: Path, monkeypatch: pytest.MonkeyPatch, kernel_ms: float, kept: bool
) -> None:
    model = kit.PagedRunner(llama_dir).model
    monkeypatch.setattr(cpu_attention, "_check_and_time", lambda m, k, timed: (1e-7, 1e-3, kernel_ms * 1e-3))
    decision = choose(model, "target", "auto", None)
    assert decision.kernel is kept
    assert decision.gather_ms == pytest.approx(1.0) and decision.kernel_ms == pytest.approx(kernel_ms)
    assert all((layer.attention.decode_kernel is not None) is kept for layer in model.layers)


def test_auto_measures_for_real_and_the_engine_still_runs(kit: Any, llama_dir: Path) -> None:
    engine = kit.make_engine(llama_dir, cpu_decode_attention="auto")
    (decision,) = engine.runner.decode_attention
    assert decision.gather_ms and decision.kernel_ms and "kernel" in decision.reason
    prompt = kit.random_prompts([12], seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    assert kit.run_to_completion(engine, prompt, params) == kit.run_to_completion(
        kit.make_engine(llama_dir, cpu_decode_attention="off"), prompt, params)


def test_a_kernel_that_disagrees_with_sdpa_is_not_used(kit: Any, llama_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up check compares the real kernel with gather + SDPA; here it is made to return wrong values."""
    real = cpu_attention.load()

    def wrong(*args: Any) -> torch.Tensor:
        return real(*args) + 1e-2

    monkeypatch.setattr(cpu_attention, "load", lambda: wrong)
    model = kit.PagedRunner(llama_dir).model
    decision = choose(model, "target", "auto", None)
    assert not decision.kernel and "disagrees with gather + SDPA by 0.01" in decision.reason
    assert model.layers[0].attention.decode_kernel is None
    with pytest.raises(ValueError, match="cpu_decode_attention is on, but for the target model the kernel disagrees"):
        choose(model, "target", "on", None)


def test_the_kernel_does_not_apply_where_it_cannot(kit: Any, llama_dir: Path) -> None:
    cpu, f32 = torch.device("cpu"), torch.float32
    assert unsupported_reason(cpu, f32, tensor_parallel=False) is None
    assert "CPU" in (unsupported_reason(torch.device("cuda"), f32, False) or "")
    assert "bfloat16" in (unsupported_reason(cpu, torch.bfloat16, False) or "")
    assert "tensor parallelism" in (unsupported_reason(cpu, f32, True) or "")

    engine = kit.make_engine(llama_dir, cpu_decode_attention="auto", dtype="bf16")
    (decision,) = engine.runner.decode_attention
    assert not decision.kernel and "bfloat16" in decision.reason
    with pytest.raises(ValueError, match="cpu_decode_attention is on, but for the target model the kernel is fp32"):
        kit.make_engine(llama_dir, cpu_decode_attention="on", dtype="bf16")
    off = kit.make_engine(llama_dir, cpu_decode_attention="off")
    assert [d.reason for d in off.runner.decode_attention] == ["model.cpu_decode_attention is off"]
    assert off.model.layers[0].attention.decode_kernel is None


def test_without_a_compiler_auto_gathers_and_on_is_refused(kit: Any, llama_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no c++, g++ or clang++
    monkeypatch.setenv(cpu_attention.CACHE_ENV, str(tmp_path / "cache"))
    cpu_attention.load.cache_clear()
    try:
        model = kit.PagedRunner(llama_dir).model
        decision = choose(model, "target", "auto", None)
        assert not decision.kernel and decision.reason.startswith("no C++ compiler on PATH")
        with pytest.raises(ValueError, match="no C\\+\\+ compiler on PATH"):
            choose(model, "target", "on", None)
    finally:
        cpu_attention.load.cache_clear()


def _fake_compiler(directory: Path, body: str) -> None:
    """A `c++` on PATH: answers --version, and otherwise runs body (argv: flags..., source, -o, output)."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "c++"
    script.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo fake 1.0; exit 0; fi\n{body}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def test_a_failed_build_names_the_error_and_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    _fake_compiler(tmp_path / "bin", 'for a; do out="$a"; done; echo partial > "$out"; '
                   'echo "error: no such instruction" >&2; exit 1')
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    cache = tmp_path / "cache"
    with pytest.raises(KernelUnavailable, match=r"failed to build cpu_decode_attention.cpp \(exit 1\): error: no"):
        build(cache)
    assert os.listdir(cache) == []  # the partial output was removed, nothing is cached under the final name


def test_a_build_is_cached_and_reused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = cpu_attention.find_compiler()
    assert real is not None
    calls = tmp_path / "calls"
    _fake_compiler(tmp_path / "bin", f'echo build >> "{calls}"; exec "{real}" "$@"')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")  # the assembler stays reachable
    first = build(tmp_path / "cache")
    second = build(tmp_path / "cache")
    assert first == second and first.exists()
    assert calls.read_text().count("build") == 1
    assert DecodeAttentionKernel(first).path == first
    assert build(tmp_path / "cache", defines=("SPECDEPLOY_GENERIC",)) != first  # another build, another file


def test_an_unwritable_cache_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(KernelUnavailable, match=f"cannot write the kernel cache .*{cpu_attention.CACHE_ENV}"):
        build(blocked / "kernels")



portable = pytest.mark.skipif(platform.machine() not in cpu_attention.PORTABLE,
                              reason=f"no portable build is defined for {platform.machine()}")


@portable
def test_portable_builds_compute_the_same_and_the_best_one_the_cpu_runs_is_chosen(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What the server image ships (its runtime has no compiler): every variant equals gathered SDPA, the loader
    takes the first variant whose CPU features this CPU has, and never a build of other source."""
    built = cpu_attention.prebuild(tmp_path)
    variants = cpu_attention.PORTABLE[platform.machine()]
    assert len(built) == len(variants) and all(cpu_attention._source_digest() in p.name for p in built)
    g = torch.Generator().manual_seed(3)
    k_pool, v_pool = torch.randn(32, 16, 4, 32, generator=g), torch.randn(32, 16, 4, 32, generator=g)
    lens = torch.tensor([1, 17, 90])
    tables = torch.randperm(32, generator=g)[:18].view(3, 6)
    q = torch.randn(3, 8, 32, generator=g)
    want = reference(q, k_pool, v_pool, tables, lens - 1, lens, 2)
    for path, (name, _, needs) in zip(built, variants, strict=True):
        if set(needs) <= cpu_attention._cpu_flags():  # a variant this CPU cannot run is not called
            got = DecodeAttentionKernel(path, name)(q, k_pool, v_pool, tables, lens - 1, lens, 2, 32**-0.5)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)

    monkeypatch.setattr(cpu_attention, "_cpu_flags", lambda: set())  # a CPU with none of the optional features
    assert cpu_attention.find_prebuilt(tmp_path) == (built[-1], variants[-1][0])
    monkeypatch.setattr(cpu_attention, "_cpu_flags", lambda: {f for _, _, needs in variants for f in needs})
    assert cpu_attention.find_prebuilt(tmp_path) == (built[0], variants[0][0])
    monkeypatch.setattr(cpu_attention, "_source_digest", lambda: "0" * 16)  # the source changed since the build
    assert cpu_attention.find_prebuilt(tmp_path) is None


@portable
def test_without_a_compiler_the_engine_uses_the_prebuilt_kernel(kit: Any, llama_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    prebuilt = tmp_path / "prebuilt"
    cpu_attention.prebuild(prebuilt)
    monkeypatch.setattr(cpu_attention, "PREBUILT_DIR", prebuilt)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    cpu_attention.load.cache_clear()
    try:
        engine = kit.make_engine(llama_dir, cpu_decode_attention="auto")
        (decision,) = engine.runner.decode_attention
        assert "(prebuilt " in decision.reason
        forced = kit.make_engine(llama_dir, cpu_decode_attention="on")
        assert forced.runner.decode_attention[0].reason.startswith("model.cpu_decode_attention is on (prebuilt ")
        prompt = kit.random_prompts([12], seed=5)
        params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
        assert kit.run_to_completion(forced, prompt, params) == kit.run_to_completion(
            kit.make_engine(llama_dir, cpu_decode_attention="off"), prompt, params)
    finally:
        cpu_attention.load.cache_clear()


def test_the_prebuild_command_names_a_missing_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        cpu_attention.main(["prebuild", str(tmp_path / "out")])
    assert exit_info.value.code == 1
    assert "error: no C++ compiler on PATH" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@portable
def test_a_failed_build_falls_back_to_the_prebuilt_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    prebuilt = tmp_path / "prebuilt"
    cpu_attention.prebuild(prebuilt)  # with the real compiler
    monkeypatch.setattr(cpu_attention, "PREBUILT_DIR", prebuilt)
    monkeypatch.setenv(cpu_attention.CACHE_ENV, str(tmp_path / "cache"))
    _fake_compiler(tmp_path / "bin", 'echo "internal compiler error" >&2; exit 4')
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    cpu_attention.load.cache_clear()
    try:
        assert cpu_attention.load().origin.startswith("prebuilt ")
        cpu_attention.load.cache_clear()
        monkeypatch.setattr(cpu_attention, "PREBUILT_DIR", tmp_path / "none")
        with pytest.raises(KernelUnavailable, match="internal compiler error.*, and no prebuilt kernel"):
            cpu_attention.load()
    finally:
        cpu_attention.load.cache_clear()


def test_compare_times_two_builds_of_the_kernel_on_the_same_inputs(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`compare OTHER.cpp`: both built, both run on each shape (here the source against itself, so the outputs
    are identical), one row per shape; a missing file is named."""
    shapes = (("tiny decode", 2, 2, 32, 3, 40, 1), ("tiny verify", 2, 2, 32, 2, 40, 3))
    results = cpu_attention.compare(cpu_attention.SOURCE, shapes, rounds=1, calls=1)
    assert [(r.shape, r.sequences, r.context, r.query) for r in results] == [
        ("tiny decode", 3, 40, 1), ("tiny verify", 2, 40, 3)]
    assert all(r.max_difference == 0.0 and r.this_ms > 0 and r.other_ms > 0 for r in results)
    with pytest.raises(SystemExit) as exit_info:
        cpu_attention.main(["compare", str(tmp_path / "missing.cpp")])
    assert exit_info.value.code == 1 and "no kernel source at" in capsys.readouterr().err
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    with pytest.raises(SystemExit):
        cpu_attention.main(["compare", str(broken)])
    assert "failed to build broken.cpp" in capsys.readouterr().err
