"""Load-time weight quantization: the kernels, the loader and the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from serving.config import ServerConfig
from serving.engine.config import EngineConfig
from serving.engine.loader import load_model
from serving.engine.quant import (
    Fp8Linear,
    Int8Embedding,
    Int8Linear,
    QuantizationUnsupported,
    check_supported,
    quantize_fp8,
    quantize_int8,
)
from serving.engine.types import SamplingParams

CPU = torch.device("cpu")


def test_int8_round_trip_error_is_at_most_half_a_step_per_row() -> None:
    w = torch.randn(48, 80) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different magnitude
    w[5] = 0.0
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert int(q.abs().max()) == 127
    err = (q.float() * scale[:, None] - w).abs().amax(dim=1)
    assert torch.all(err <= scale / 2 + 1e-7)
    assert torch.all(q[5] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_equals_the_dequantized_matmul(dtype: torch.dtype) -> None:
    w, b, x = torch.randn(40, 64), torch.randn(40), torch.randn(3, 5, 64)
    q, scale = quantize_int8(w)
    layer = Int8Linear(64, 40, bias=True, dtype=dtype)
    layer.qweight, layer.scales, layer.bias = q, scale.to(dtype), b.to(dtype)
    want = F.linear(x.to(dtype).float(), q.float() * scale.to(dtype).float()[:, None], b.to(dtype).float())
    got = layer(x.to(dtype))
    assert got.shape == (3, 5, 40) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_int8_embedding_rows_are_dequantized_table_rows() -> None:
    table = torch.randn(30, 16)
    q, scale = quantize_int8(table)
    emb = Int8Embedding(30, 16, torch.float32)
    emb.qweight, emb.scales = q, scale
    ids = torch.tensor([0, 29, 7, 7])
    torch.testing.assert_close(emb(ids), q[ids].float() * scale[ids, None])


def test_fp8_linear_is_close_to_the_float_matmul() -> None:
    # the module's arithmetic runs on CPU too (torch._scaled_mm); only the configuration refuses fp8 here
    w, x = torch.randn(32, 64), torch.randn(6, 64)
    q, scale = quantize_fp8(w)
    layer = Fp8Linear(64, 32, bias=False, dtype=torch.float32)
    layer.qweight, layer.scales = q, scale.reshape(1, -1)
    want = x @ w.T
    rel = (layer(x) - want).norm() / want.norm()
    assert rel < 0.08  # e4m3 keeps 3 mantissa bits: a few percent, never more


def test_fp8_is_refused_on_cpu_with_what_to_use_instead() -> None:
    with pytest.raises(QuantizationUnsupported, match=r"fp8 needs a CUDA GPU of compute capability >= 8.9.*int8"):
        check_supported("fp8", CPU)
    with pytest.raises(QuantizationUnsupported, match="unknown model.quantization 'int4'"):
        check_supported("int4", CPU)
    check_supported("int8", CPU)
    check_supported("none", CPU)


def test_fp8_is_refused_below_compute_capability_8_9(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-40GB")
    with pytest.raises(QuantizationUnsupported, match=r"A100-SXM4-40GB has 8\.0"):
        check_supported("fp8", torch.device("cuda"))


def _logits(model: Any, kit: Any, tokens: list[int]) -> torch.Tensor:
    from serving.engine.batch import SequenceInput, build_forward_batch
    from serving.engine.kv_cache import KVCache

    a = model.args
    cache = KVCache(a.n_layers, 8, 16, a.n_kv_heads, a.head_dim, model.dtype, CPU)
    batch = build_forward_batch([SequenceInput(tokens, 0, list(range(8)), list(range(len(tokens))))], 16, a.n_rep,
                                CPU, model.dtype)
    with torch.inference_mode():
        return model.compute_logits(model(batch, cache), batch.logits_index)


@pytest.mark.parametrize("model_type,tied", [("llama", False), ("qwen2", False), ("llama", True)])
def test_int8_model_logits_track_fp32(kit: Any, tmp_path: Path, model_type: str, tied: bool) -> None:
    model_dir = kit.save_tiny_model(tmp_path, model_type, tie_word_embeddings=tied)
    fp32 = load_model(model_dir, torch.float32, CPU, 128)
    int8 = load_model(model_dir, torch.float32, CPU, 128, "int8")
    assert int8.quantization == "int8" and int8.dtype == torch.float32
    assert all(p.dtype != torch.float32 for n, p in int8.named_buffers() if n.endswith("qweight"))
    if tied:  # one int8 table serves the embedding and the lm_head
        assert int8.output.qweight is int8.tok_embeddings.qweight
    tokens = kit.random_prompts([40])[0]
    want, got = _logits(fp32, kit, tokens), _logits(int8, kit, tokens)
    assert (got - want).norm() / want.norm() < 0.05  # random weights: ~0.7 % rms error per matmul, compounded
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_engine_serves_int8_weights_from_the_server_config(kit: Any, llama_dir: Path) -> None:
    server = ServerConfig.model_validate({"model": {"path": str(llama_dir), "quantization": "int8", "dtype": "fp32"}})
    assert EngineConfig.from_server_config(server).quantization == "int8"
    engine = kit.make_engine(llama_dir, quantization="int8")
    assert engine.model.quantization == "int8" and engine.dtype == torch.float32
    out = kit.run_to_completion(engine, kit.random_prompts([7, 12]), [SamplingParams(temperature=0.0, max_tokens=6,
                                                                                      ignore_eos=True)] * 2)
    assert [len(o) for o in out] == [6, 6]


def test_engine_refuses_fp8_on_cpu_before_loading(kit: Any, llama_dir: Path) -> None:
    with pytest.raises(QuantizationUnsupported, match="fp8"):
        kit.make_engine(llama_dir, quantization="fp8")
