"""Matmul weights packed for oneDNN on CPU (serving.engine.kernels.cpu_linear, `model.cpu_weight_packing`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from serving.engine.kernels import cpu_linear
from serving.engine.kernels.cpu_linear import PackedLinear, choose, pack, unsupported_reason
from serving.engine.types import SamplingParams

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 9, 33])
def test_a_packed_linear_computes_what_linear_does(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(rows, 64, generator=g)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(weight, bias)(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(PackedLinear(weight, None)(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
        # leading dimensions are kept
        x3 = x.view(1, rows, 64)
        assert PackedLinear(weight, None)(x3).shape == (1, rows, 96)


def test_packing_replaces_every_linear_and_keeps_a_tied_embedding_dense(kit: Any, llama_dir: Path) -> None:
    model = kit.PagedRunner(llama_dir).model
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    pack(model)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert all(isinstance(model.get_submodule(name), PackedLinear) for name in linears)
    assert isinstance(model.tok_embeddings.weight, torch.Tensor) and not model.tok_embeddings.weight.is_mkldnn


def test_packed_and_plain_engines_agree_with_speculation_and_prefix_caching(
    kit: Any, llama_dir: Path, qwen2_dir: Path
) -> None:
    """Spec-off and spec-on steps run the same packed weights, so drafts are verified against the same logits."""
    shared = kit.random_prompts([40], seed=11)[0]
    prompts = [shared + p for p in kit.random_prompts([6, 13, 3], seed=12)] + kit.random_prompts([21], seed=13)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
    spec = {"enabled": True, "method": "draft", "draft_model": str(qwen2_dir), "num_draft_tokens": 4}
    outputs = {}
    for packing in ("off", "on"):
        engine = kit.make_engine(llama_dir, cpu_weight_packing=packing, speculative=spec)
        assert [(d.model, d.packed) for d in engine.runner.weight_packing] == [("target", packing == "on"),
                                                                        ("draft", packing == "on")]
        outputs[packing] = kit.run_to_completion(engine, prompts, params)
        assert engine.stats().spec.num_draft_tokens > 0
        assert engine.blocks.num_used == 0
    plain = kit.run_to_completion(kit.make_engine(llama_dir), prompts, params)  # no speculation, plain weights
    assert outputs["on"] == outputs["off"] == plain


@pytest.mark.parametrize("packed_ms, packed_wide_ms, kept", [
    (1.0, 4.0, True), (1.02, 4.0, True), (1.2, 4.0, False),  # no faster at 16 tokens: the one-token step decides
    (1.1, 2.0, True),  # 10 % dearer at one token, 2x cheaper at 16: packed
    (1.0, 4.4, False),  # as fast at one token, 10 % dearer at 16: dense
])
def test_auto_packs_unless_its_worse_shape_is_further_from_the_best(
    kit: Any, llama_dir: Path, monkeypatch: pytest.MonkeyPatch, packed_ms: float, packed_wide_ms: float, kept: bool
) -> None:
    """`auto` times dense and packed one- and 16-token steps (here: a stand-in clock, dense 1 and 4 ms) and leaves
    the model as chosen."""
    model = kit.PagedRunner(llama_dir).model

    def fake_seconds(m: nn.Module, context: int, new_tokens: int, repeats: int = 20) -> float:
        assert new_tokens in (1, cpu_linear.WIDE_STEP) and context + new_tokens < m.max_model_len
        is_packed = isinstance(m.layers[0].attention.wqkv, PackedLinear)
        if new_tokens == 1:
            return (packed_ms if is_packed else 1.0) * 1e-3
        return (packed_wide_ms if is_packed else 4.0) * 1e-3

    monkeypatch.setattr(cpu_linear, "forward_seconds", fake_seconds)
    decision = choose(model, "target", "auto", None)
    assert decision.packed is kept
    assert decision.dense_step_ms == pytest.approx(1.0) and decision.packed_step_ms == pytest.approx(packed_ms)
    assert decision.dense_wide_ms == pytest.approx(4.0) and decision.packed_wide_ms == pytest.approx(packed_wide_ms)
    kinds = {type(m) for name, m in model.named_modules() if name.endswith(("wqkv", "wo", "w13", "w2", "output"))}
    assert kinds == ({PackedLinear} if kept else {nn.Linear})


def test_auto_measures_the_real_steps_and_the_model_still_runs(kit: Any, llama_dir: Path) -> None:
    engine = kit.make_engine(llama_dir, cpu_weight_packing="auto")
    (decision,) = engine.runner.weight_packing
    assert decision.dense_step_ms and decision.packed_step_ms and "packed vs" in decision.reason
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    prompt = kit.random_prompts([12], seed=5)
    assert kit.run_to_completion(engine, prompt, params) == kit.run_to_completion(kit.make_engine(llama_dir),
                                                                                  prompt, params)


def test_packing_does_not_apply_where_it_cannot(kit: Any, llama_dir: Path) -> None:
    cpu, f32 = torch.device("cpu"), torch.float32
    assert unsupported_reason(cpu, f32, "none", compiled=False, tensor_parallel=False) is None
    assert "CPU" in (unsupported_reason(torch.device("cuda"), f32, "none", False, False) or "")
    assert "int8" in (unsupported_reason(cpu, f32, "int8", False, False) or "")
    assert "fp32 and bf16" in (unsupported_reason(cpu, torch.float16, "none", False, False) or "")
    assert "compile" in (unsupported_reason(cpu, f32, "none", True, False) or "")
    assert "tensor parallel" in (unsupported_reason(cpu, f32, "none", False, True) or "")

    engine = kit.make_engine(llama_dir, cpu_weight_packing="on", quantization="int8")
    (decision,) = engine.runner.weight_packing
    assert not decision.packed and "int8" in decision.reason
    off = kit.make_engine(llama_dir)
    assert [d.reason for d in off.runner.weight_packing] == ["model.cpu_weight_packing is off"]


def test_compiling_an_engine_with_packed_weights_is_refused_by_name(kit: Any, llama_dir: Path) -> None:
    engine = kit.make_engine(llama_dir, cpu_weight_packing="on")
    with pytest.raises(ValueError, match="cpu_weight_packing"):
        engine.runner.compile_steps(measure=False)


def test_weight_bytes_count_packed_weights(kit: Any, llama_dir: Path) -> None:
    from serving.engine.quant import weight_bytes

    model = kit.PagedRunner(llama_dir).model
    dense = weight_bytes(model)
    tied = model.args.tie_word_embeddings
    pack(model)
    # a tied lm_head gets its own packed copy beside the embedding's dense table
    extra = model.output.weight_nbytes if tied else 0
    assert weight_bytes(model) == dense + extra
