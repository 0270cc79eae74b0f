"""The CUDA path's Triton kernels (serving.engine.kernels.triton_kernels), run on CPU under Triton's interpreter.

Triton decides at decoration time whether a kernel is compiled or interpreted (TRITON_INTERPRET, read when
`triton.jit` runs), so the fixture loads a private copy of the module with the variable set and restores it at
once: nothing else in the test process sees it, and `serving.engine.kernels.triton_kernels` itself is untouched.
Each kernel is held against a float64 reference; shapes stay tiny because the interpreter is slow. The tests
marked gpu hold the compiled kernels against the same reference on a card at Llama-3-8B's head shapes (`make
gpu-test`); the kernels inside the engine's compiled and captured steps are in test_gpu_kernels.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from serving.engine.batch import ForwardBatchBuilder, SequenceInput, build_forward_batch
from serving.engine.kernels.gpu_kernels import enable_triton_kernels, triton_kernels_refusal
from serving.engine.model import KERNEL_MAX_QUERY

# Triton comes with xgrammar in the development environment and with CUDA torch on a GPU host
pytest.importorskip("triton", reason="Triton is not installed here")
import serving.engine.kernels.triton_kernels as compiled_kernels  # noqa: E402


@pytest.fixture(scope="module")
def tk() -> ModuleType:
    """serving/engine/kernels/triton_kernels.py loaded again with TRITON_INTERPRET=1: its kernels run on CPU tensors."""
    path = Path(compiled_kernels.__file__)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        spec = importlib.util.spec_from_file_location("_interpreted_triton_kernels", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def reference_attention(q_pad: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, tables: torch.Tensor,
                        q_start: torch.Tensor, seq_lens: torch.Tensor, q_lens: list[int], scale: float,
                        k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None) -> torch.Tensor:
    """float64, one (sequence, query token, head) at a time: [G * max_q, Hq * D], zeros in padding rows."""
    g = tables.shape[0]
    _, bs, hkv, d = k_blocks.shape
    hq = q_pad.shape[1]
    max_q = q_pad.shape[0] // g
    rep = hq // hkv
    out = torch.zeros(g * max_q, hq * d, dtype=torch.float64)
    for s in range(g):
        keys = k_blocks[tables[s]].reshape(-1, hkv, d)[: int(seq_lens[s])].double()
        values = v_blocks[tables[s]].reshape(-1, hkv, d)[: int(seq_lens[s])].double()
        if k_new is not None and v_new is not None:  # the row's own key, after its context
            keys = torch.cat([keys, k_new[s, None].double()])
            values = torch.cat([values, v_new[s, None].double()])
        for j in range(q_lens[s]):
            seen = int(q_start[s]) + j + 1 if k_new is None else keys.shape[0]
            for h in range(hq):
                scores = keys[:seen, h // rep] @ q_pad[s * max_q + j, h].double() * scale
                out[s * max_q + j, h * d : (h + 1) * d] = torch.softmax(scores, 0) @ values[:seen, h // rep]
    return out


def real_rows(out: torch.Tensor, q_lens: list[int], max_q: int) -> torch.Tensor:
    return torch.cat([out[s * max_q : s * max_q + n] for s, n in enumerate(q_lens)])


def random_cache(num_blocks: int, block_size: int, hkv: int, d: int, dtype: torch.dtype,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    return k, v


# (name, query lengths per sequence, context lengths after the step, n_rep, head_dim)
GROUPS = [
    ("decode-gqa", [1, 1, 1], [40, 1, 64], 2, 16),
    ("decode-mha", [1, 1], [17, 33], 1, 16),
    ("verify-gqa", [5, 3, 1], [45, 20, 64], 4, 16),
    ("verify-head-dim-24", [4, 2], [30, 50], 2, 24),  # a head dim that is not a power of two is masked
]


@pytest.mark.parametrize("splits", [1, 2, 4, None])
@pytest.mark.parametrize(("name", "q_lens", "seq_lens", "n_rep", "d"), GROUPS, ids=[g[0] for g in GROUPS])
def test_paged_decode_attention_equals_float64_reference(tk: ModuleType, name: str, q_lens: list[int],
                                                         seq_lens: list[int], n_rep: int, d: int,
                                                         splits: int | None) -> None:
    bs, hkv = 16, 2
    k, v = random_cache(12, bs, hkv, d, torch.float32)
    # scattered, shared (block 3: a prefix two sequences hold) and out-of-order blocks; padding entries are 0
    tables = torch.tensor([[3, 7, 1, 0], [3, 2, 10, 11], [9, 4, 11, 8]])[: len(q_lens)]
    max_q = max(q_lens)
    seq = torch.tensor(seq_lens)
    q_start = seq - torch.tensor(q_lens)
    q_pad = torch.randn(len(q_lens) * max_q, hkv * n_rep, d, generator=torch.Generator().manual_seed(1))
    got = tk.paged_decode_attention(q_pad, k, v, tables, q_start, seq, n_rep, d**-0.5, splits=splits)
    want = reference_attention(q_pad, k, v, tables, q_start, seq, q_lens, d**-0.5)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(real_rows(got, q_lens, max_q).double(), real_rows(want, q_lens, max_q),
                               atol=2e-6, rtol=1e-5)


def test_largest_scores_in_a_later_block_and_split(tk: ModuleType) -> None:
    """The online softmax rescales what a row has added when its maximum grows, and the merge weighs splits by
    their log-sum-exp: keys of the last block, far larger, must dominate exactly as in the reference."""
    bs, hkv, d = 16, 1, 16
    k, v = random_cache(6, bs, hkv, d, torch.float32, seed=2)
    k[5] *= 6.0
    tables = torch.tensor([[0, 1, 2, 3, 4, 5]])
    seq, q_start = torch.tensor([96]), torch.tensor([95])
    q_pad = torch.randn(1, 2, d, generator=torch.Generator().manual_seed(3))
    want = reference_attention(q_pad, k, v, tables, q_start, seq, [1], d**-0.5)
    for splits in (1, 2, 8):  # 8 splits of 6 blocks: some splits see nothing
        got = tk.paged_decode_attention(q_pad, k, v, tables, q_start, seq, 2, d**-0.5, splits=splits)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_with_new_key_equals_float64_reference(tk: ModuleType, dtype: torch.dtype) -> None:
    """A decode step captured whole: the new key and value join the cached context in the merge; a row with no
    context (ctx_lens 0) sees its own key only."""
    bs, hkv, rep, d = 16, 2, 2, 16
    k, v = random_cache(10, bs, hkv, d, dtype)
    gen = torch.Generator().manual_seed(4)
    tables = torch.tensor([[4, 2, 0, 0], [7, 0, 0, 0], [1, 3, 5, 9]], dtype=torch.int32)  # captured: int32, W wide
    ctx = torch.tensor([20, 0, 63])
    qkv = torch.randn(3, hkv * rep + 2 * hkv, d, generator=gen).to(dtype)  # the fused projection's rows
    q, k_new, v_new = qkv[:, : hkv * rep], qkv[:, hkv * rep : -hkv], qkv[:, -hkv:]  # views, read in place
    got = tk.decode_with_new_key(q, k_new, v_new, k, v, tables, ctx, d**-0.5)
    want = reference_attention(q, k, v, tables.long(), ctx, ctx, [1, 1, 1], d**-0.5, k_new, v_new)
    assert got.dtype == dtype
    tol = 2e-6 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_bf16_attention_is_within_bf16_rounding(tk: ModuleType) -> None:
    bs, hkv, rep, d = 16, 2, 4, 16
    k, v = random_cache(8, bs, hkv, d, torch.bfloat16)
    tables = torch.tensor([[5, 1, 6, 0], [2, 3, 4, 7]])
    seq, q_lens = torch.tensor([41, 64]), [3, 3]
    q_pad = torch.randn(6, hkv * rep, d, generator=torch.Generator().manual_seed(5)).bfloat16()
    got = tk.paged_decode_attention(q_pad, k, v, tables, seq - 3, seq, rep, d**-0.5)
    want = reference_attention(q_pad, k, v, tables, seq - 3, seq, q_lens, d**-0.5)
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 48])  # 48: the last tile is masked
def test_residual_rmsnorm_equals_float64_reference(tk: ModuleType, dtype: torch.dtype, dim: int) -> None:
    gen = torch.Generator().manual_seed(6)
    x, residual = torch.randn(5, dim, generator=gen).to(dtype), torch.randn(5, dim, generator=gen).to(dtype)
    weight = torch.randn(dim, generator=gen).to(dtype)
    normed, h = tk.residual_rmsnorm(x, residual, weight, 1e-6)
    h64 = x.double() + residual.double()
    want = weight.double() * h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-6)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(h.double(), h64, atol=tol, rtol=tol)
    torch.testing.assert_close(normed.double(), want, atol=tol, rtol=tol)


def test_residual_rmsnorm_rounds_as_the_model_does(tk: ModuleType) -> None:
    """In bf16 the sum is rounded before the norm, and the normalised row before the scale (model.RMSNorm), so the
    fused kernel is within a few bf16 steps of `RMSNorm(x + residual)`. (The interpreter narrows to bf16 by truncating
    where a GPU rounds to nearest: bit equality with the model is checked on the GPU, test_gpu_kernels.py.)"""
    from serving.engine.model import RMSNorm

    gen = torch.Generator().manual_seed(7)
    norm = RMSNorm(64, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen))
    x, residual = torch.randn(8, 64, generator=gen).bfloat16(), torch.randn(8, 64, generator=gen).bfloat16()
    normed, h = tk.residual_rmsnorm(x, residual, norm.weight.detach(), norm.eps)
    torch.testing.assert_close(h, x + residual, atol=0, rtol=2**-7)  # one bf16 step
    with torch.no_grad():
        want = norm(x + residual)
    torch.testing.assert_close(normed.float(), want.float(), atol=1e-6, rtol=2**-5)  # two truncations: a few steps


def test_splits_fill_the_device_and_never_exceed_the_blocks() -> None:
    assert compiled_kernels.num_splits(1, 8, 128) == 32  # batch 1, 8 KV heads: 256 programs
    assert compiled_kernels.num_splits(1, 8, 3) == 4  # no more splits than the table's blocks (next power of 2)
    assert compiled_kernels.num_splits(64, 8, 128) == 1  # 512 programs already
    assert compiled_kernels.num_splits(1, 1, 10_000) == 64  # capped


def test_kernels_are_refused_off_cuda_and_outside_their_shapes(llama_dir: Path, kit: Any) -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert triton_kernels_refusal(cuda, True, 16, 128) is None
    assert "CUDA only" in (triton_kernels_refusal(cpu, True, 16, 128) or "")
    assert "paged attention" in (triton_kernels_refusal(cuda, False, 16, 128) or "")
    assert "power of two" in (triton_kernels_refusal(cuda, True, 24, 128) or "")
    assert "power of two" in (triton_kernels_refusal(cuda, True, 8, 128) or "")
    assert "head_dim" in (triton_kernels_refusal(cuda, True, 16, 512) or "")
    runner = kit.PagedRunner(llama_dir)
    with pytest.raises(ValueError, match="CUDA only"):  # the CPU path never changes
        enable_triton_kernels(runner.model, 16)
    assert runner.model.captured_decode_kernel is None


def _steps(kit: Any, runner: Any) -> list[list[SequenceInput]]:
    """A prefill, a decode step and a verify-shaped step (one sequence sharing another's first block)."""
    prompts = kit.random_prompts([37, 20], seed=3)
    blocks = runner.blocks
    for sid, n in ((0, 42), (1, 24)):
        blocks.allocate(str(sid), n)
    t0, t1 = blocks.block_table("0"), blocks.block_table("1")
    blocks.allocate("2", 40)
    shared = t0[:1] + blocks.block_table("2")[1:]
    return [
        [SequenceInput(prompts[0], 0, t0, [36]), SequenceInput(prompts[1], 0, t1, [19])],
        [SequenceInput([5], 37, t0, [0]), SequenceInput([9], 20, t1, [0])],
        [SequenceInput([6, 7, 8, 9], 38, t0, [0, 1, 2, 3]), SequenceInput([1, 2, 3], 21, t1, [0, 1, 2]),
         SequenceInput(prompts[0][16:20], 16, shared, [0, 1, 2, 3])],
    ]


@pytest.mark.slow  # FlexAttention compiles on CPU per shape (about a minute)
def test_model_with_triton_kernels_equals_its_paged_path(tk: ModuleType, llama_dir: Path, kit: Any) -> None:
    """The dispatch: with the (interpreted) kernels set, decode and verify groups attend through the Triton
    kernel, prefill keeps FlexAttention, and the MLP's norm is fused: logits equal the plain paged path's."""
    runs = []
    for kernels in (False, True):
        runner = kit.PagedRunner(llama_dir)
        runner.model.set_paged_attention(True)
        if kernels:
            runner.model.set_triton_kernels(tk.paged_decode_attention, tk.decode_with_new_key, tk.residual_rmsnorm)
        logits = []
        for seqs in _steps(kit, runner):
            batch = build_forward_batch(seqs, 16, runner.model.args.n_rep, runner.device)
            with torch.inference_mode():
                logits.append(runner.model.compute_logits(runner.model(batch, runner.cache), batch.logits_index))
        runs.append(logits)
    for plain, fused in zip(*runs, strict=True):
        torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)


def test_model_dispatch_reaches_the_kernels(tk: ModuleType, llama_dir: Path, kit: Any) -> None:
    """Without FlexAttention (which compiles on CPU): a decode and a verify step go through the paged decode kernel
    and the fused norm, whose logits equal the gather path's; prefill would not reach the kernel."""
    calls: dict[str, int] = {"attention": 0, "norm": 0}

    def attention(*args: Any) -> torch.Tensor:
        calls["attention"] += 1
        return tk.paged_decode_attention(*args)  # type: ignore[no-any-return]

    def norm(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls["norm"] += 1
        return tk.residual_rmsnorm(*args)  # type: ignore[no-any-return]

    plain, fused = kit.PagedRunner(llama_dir), kit.PagedRunner(llama_dir)
    fused.model.set_triton_kernels(attention, tk.decode_with_new_key, norm)
    # as enable_triton_kernels sets the engine's builder: decode and verify sequences make one group
    builder = ForwardBatchBuilder(16, fused.model.args.n_rep, fused.device)
    builder.in_place_max_q = KERNEL_MAX_QUERY
    steps = _steps(kit, plain)
    _steps(kit, fused)
    layers = plain.model.args.n_layers
    for i, seqs in enumerate(steps):
        logits = []
        for runner in (plain, fused):
            # prefill runs gather + SDPA in both; decode and verify steps of `fused` take the kernel
            runner.model.set_paged_attention(runner is fused and i > 0)
            batch = (builder.build(seqs) if runner is fused else
                     build_forward_batch(seqs, 16, runner.model.args.n_rep, runner.device))
            with torch.inference_mode():
                logits.append(runner.model.compute_logits(runner.model(batch, runner.cache), batch.logits_index))
        torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
    assert calls == {"attention": 2 * layers, "norm": 3 * layers}  # one group per decode and verify step


def test_captured_decode_step_through_the_kernel_equals_the_eager_step(tk: ModuleType, llama_dir: Path,
                                                                       kit: Any) -> None:
    """Transformer.forward_decode (what a captured decode graph runs) with the kernel: the same hidden states and
    new K/V as the eager decode step, which writes the cache first and attends through gather + SDPA."""
    runner = kit.PagedRunner(llama_dir)
    model = runner.model
    prefill, decode = _steps(kit, runner)[:2]
    n_rep = model.args.n_rep
    layers_called: list[int] = []

    def kernel(*args: Any) -> torch.Tensor:
        layers_called.append(1)
        return tk.decode_with_new_key(*args)  # type: ignore[no-any-return]

    with torch.inference_mode():
        model(build_forward_batch(prefill, 16, n_rep, runner.device), runner.cache)
        model.set_triton_kernels(None, kernel, None)
        tables = torch.zeros(2, 8, dtype=torch.int32)  # padded to a static width, as DecodeGraph does
        for row, seq in enumerate(decode):
            tables[row, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        ctx = torch.tensor([s.start_pos for s in decode])
        ids = torch.tensor([s.token_ids[0] for s in decode])
        hidden, new_k, new_v = model.forward_decode(ids, ctx, tables, ctx, runner.cache)
        model.set_triton_kernels(None, None, None)
        batch = build_forward_batch(decode, 16, n_rep, runner.device)
        want = model(batch, runner.cache)  # writes the step's K/V into the cache
    assert len(layers_called) == model.args.n_layers  # every layer attended through the kernel
    order = [0, 1] if batch.positions.tolist() == ctx.tolist() else [1, 0]  # flat-row order of the eager batch
    torch.testing.assert_close(hidden[order], want, atol=1e-5, rtol=1e-5)
    slots, layers = batch.slot_mapping, model.args.n_layers
    torch.testing.assert_close(new_k[:, order], runner.cache.k.view(layers, -1, *new_k.shape[2:])[:, slots])
    torch.testing.assert_close(new_v[:, order], runner.cache.v.view(layers, -1, *new_v.shape[2:])[:, slots])


# ---- the compiled kernels on a GPU (make gpu-test) --------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-test)")


@pytest.mark.parametrize("q_lens", [[1] * 5, [13, 9, 5, 1, 13]], ids=["decode", "verify"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@needs_cuda
def test_compiled_attention_on_cuda_at_8b_head_shapes(dtype: torch.dtype, q_lens: list[int]) -> None:
    """Llama-3-8B's heads (8 KV heads of 4 query heads, head dim 128), 16-token blocks, contexts of 1 to 2,048
    keys, tables in random order: the compiled kernel against float64, with and without the new key."""
    bs, hkv, rep, d = 16, 8, 4, 128
    seq_lens = torch.tensor([13, 17, 300, 1000, 2048])
    k, v = random_cache(700, bs, hkv, d, dtype)
    gen = torch.Generator().manual_seed(8)
    tables = torch.randperm(700, generator=gen)[: 5 * 128].view(5, 128)
    max_q = max(q_lens)
    q_start = seq_lens - torch.tensor(q_lens)
    q_pad = torch.randn(5 * max_q, hkv * rep, d, generator=gen).to(dtype)
    scale, cuda = d**-0.5, torch.device("cuda")
    got = compiled_kernels.paged_decode_attention(q_pad.to(cuda), k.to(cuda), v.to(cuda), tables.to(cuda),
                                                  q_start.to(cuda), seq_lens.to(cuda), rep, scale).cpu()
    want = reference_attention(q_pad, k, v, tables, q_start, seq_lens, q_lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(real_rows(got, q_lens, max_q).double(), real_rows(want, q_lens, max_q), atol=tol,
                               rtol=tol)
    if max_q == 1:  # decode captured whole: the cached context plus a new key per row
        k_new, v_new = torch.randn(5, hkv, d, generator=gen).to(dtype), torch.randn(5, hkv, d, generator=gen).to(dtype)
        ctx = seq_lens - 1
        got = compiled_kernels.decode_with_new_key(q_pad.to(cuda), k_new.to(cuda), v_new.to(cuda), k.to(cuda),
                                                   v.to(cuda), tables.int().to(cuda), ctx.to(cuda), scale).cpu()
        want = reference_attention(q_pad, k, v, tables, ctx, ctx, q_lens, scale, k_new, v_new)
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.gpu
@needs_cuda
def test_compiled_residual_rmsnorm_on_cuda_rounds_as_the_model() -> None:
    """On a GPU the sum is bit-equal to `x + residual` and the norm to the model's RMSNorm but for the fp32
    reduction's order (one bf16 step at most, on few elements)."""
    from serving.engine.model import RMSNorm

    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(9)
    norm = RMSNorm(4096, 1e-5).to(cuda, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(4096, generator=gen))
    x = torch.randn(64, 4096, generator=gen).bfloat16().to(cuda)
    residual = torch.randn(64, 4096, generator=gen).bfloat16().to(cuda)
    normed, h = compiled_kernels.residual_rmsnorm(x, residual, norm.weight.detach(), norm.eps)
    assert torch.equal(h, x + residual)
    with torch.no_grad():
        want = norm(x + residual)
    torch.testing.assert_close(normed.float(), want.float(), atol=1e-6, rtol=2**-7)
    assert (normed != want).float().mean().item() < 0.01


def test_the_ops_torch_compile_traces_have_the_kernels_shapes() -> None:
    """torch.compile traces the kernels as custom ops through their fake implementations (the captured decode
    graph and the compiled steps): shapes and dtypes as the kernels return them, with no kernel run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q_pad = torch.empty(6, 8, 16, dtype=torch.bfloat16)
        k = torch.empty(10, 16, 2, 16, dtype=torch.bfloat16)
        tables, lens = torch.empty(2, 4, dtype=torch.long), torch.empty(2, dtype=torch.long)
        out = torch.ops.specdeploy.paged_decode_attention(q_pad, k, k, tables, lens, lens, 4, 0.25)
        assert (out.shape, out.dtype) == ((6, 128), torch.bfloat16)
        q, new = torch.empty(3, 8, 16), torch.empty(3, 2, 16)
        out = torch.ops.specdeploy.decode_with_new_key(q, new, new, k.float(), k.float(), tables[:, :3].int(),
                                                      lens[:1].expand(3), 0.25)
        assert out.shape == (3, 128)
        x = torch.empty(5, 64, dtype=torch.bfloat16)
        normed, h = torch.ops.specdeploy.residual_rmsnorm(x, x, torch.empty(64, dtype=torch.bfloat16), 1e-5)
        assert normed.shape == h.shape == (5, 64) and normed.dtype == h.dtype == torch.bfloat16
