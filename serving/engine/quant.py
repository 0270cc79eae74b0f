"""Weight quantization at load time: int8 weight-only per-channel, and fp8 (e4m3) on GPUs that support it.

    int8: w ≈ q · s,  q ∈ [-127, 127] int8 per weight,  s one scale per output channel (row)
    fp8:  w ≈ q · s,  q float8_e4m3fn,                    s per output channel; activations per token

Every matmul of the decoder (qkv, o, gate/up, down, lm_head) and the embedding table are quantized;
norms and biases stay in the model dtype. A tied embedding and lm_head share one quantized table: the
embedding's per-row scale is the lm_head's per-output-channel scale.

The checkpoint on disk is untouched (the weights manifest still verifies the original files); weights are
quantized tensor by tensor from the checkpoint's bf16/fp16/fp32 values, upcast to fp32 first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import get_args

import torch
import torch.nn.functional as F
from torch import nn

from serving.config import Quantization

QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)

_INT8_MAX = 127.0
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90): fp8 tensor cores behind torch._scaled_mm


class QuantizationUnsupported(ValueError):
    """The requested quantization cannot run on this device."""


def check_supported(method: str, device: torch.device) -> None:
    """Raise QuantizationUnsupported (naming the method, device and what to use instead) if `method` cannot run."""
    if method not in QUANTIZATIONS:
        raise QuantizationUnsupported(f"unknown model.quantization {method!r}; use one of {', '.join(QUANTIZATIONS)}")
    if method != "fp8":
        return
    if device.type != "cuda":
        raise QuantizationUnsupported(
            f"model.quantization fp8 needs a CUDA GPU of compute capability >= 8.9 (Ada, Hopper); the device is "
            f"{device.type}: use model.quantization int8 or none"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise QuantizationUnsupported(
            f"model.quantization fp8 needs compute capability >= 8.9 (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: use int8 or none"
        )


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: returns (q int8 [N, K], scale fp32 [N]) with weight ≈ q * scale[:, None]."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / _INT8_MAX  # an all-zero row keeps scale > 0
    q = torch.round(w / scale[:, None]).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q, scale


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3: returns (q float8_e4m3fn [N, K], scale fp32 [N]) with weight ≈ q * scale[:, None]."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / _FP8_MAX
    return (w / scale[:, None]).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn), scale


class Int8Linear(nn.Module):
    """y = x @ (q * s)ᵀ + b: torch's int8 weight-pack matmul for bf16/fp16 on CPU, else dequantize per call."""

    qweight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, dtype=dtype))  # the activation dtype
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.device.type == "cpu" and x2.dtype != torch.float32:
            y = torch._weight_int8pack_mm(x2.contiguous(), self.qweight, self.scales)
        else:
            # CUDA has no int8-weight GEMM in torch, and the CPU kernel's fp32 path measured 8-60x slower than
            # dequantizing (bf16 x: 3-6x faster than a bf16 matmul at batch 1): widen one matrix per call
            y = F.linear(x2, self.qweight.to(x2.dtype)) * self.scales
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Fp8Linear(nn.Module):
    """Row-wise scaled fp8 GEMM (torch._scaled_mm): per-token activation scales, per-channel weight scales."""

    qweight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("scales", torch.empty(1, out_features, dtype=torch.float32))  # row-wise layout
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).float()
        x_scale = x2.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / _FP8_MAX  # [T, 1]
        xq = (x2 / x_scale).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, self.qweight.t(), scale_a=x_scale, scale_b=self.scales, out_dtype=x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Int8Embedding(nn.Module):
    """Row lookup of an int8 table with one scale per row (the same per-channel layout as Int8Linear)."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.register_buffer("qweight", torch.empty(num_embeddings, dim, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(num_embeddings, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].to(self.scales.dtype) * self.scales[ids].unsqueeze(-1)


def quantized_module_names(model: nn.Module, method: Quantization) -> list[str]:
    """The modules `method` quantizes: every nn.Linear (decoder matmuls, lm_head); int8 also the embedding
    (fp8 keeps it in the model dtype: a lookup gains nothing from an fp8 GEMM)."""
    if method == "none":
        return []
    kinds = (nn.Linear, nn.Embedding) if method == "int8" else (nn.Linear,)
    return [name for name, module in model.named_modules() if isinstance(module, kinds)]


def replace_modules(model: nn.Module, method: Quantization, dtype: torch.dtype) -> list[str]:
    """Swap the modules `method` quantizes for their quantized forms (empty buffers); returns their names."""
    names = quantized_module_names(model, method)
    linear_cls = Int8Linear if method == "int8" else Fp8Linear
    for name in names:
        module = model.get_submodule(name)
        if isinstance(module, nn.Linear):
            new: nn.Module = linear_cls(module.in_features, module.out_features, module.bias is not None, dtype)
        else:
            assert isinstance(module, nn.Embedding)
            new = Int8Embedding(module.num_embeddings, module.embedding_dim, dtype)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return names


def quantize_state_dict(
    state: dict[str, torch.Tensor], module_names: Iterable[str], method: Quantization, dtype: torch.dtype,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Turn `<module>.weight` of each named module into `<module>.qweight` + `<module>.scales` on `device`.

    Quantizes on the tensor's own (host) device, then moves only the small result: a 70B checkpoint never
    needs its float weights on the GPU. Everything else is cast to `dtype` and moved."""
    if method == "none":
        return {name: t.to(device=device, dtype=dtype) for name, t in state.items()}
    targets = {f"{m}.weight" for m in module_names}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name not in targets:
            out[name] = tensor.to(device=device, dtype=dtype)
            continue
        module = name.removesuffix(".weight")
        if method == "int8":
            q, scale = quantize_int8(tensor)
            out[f"{module}.scales"] = scale.to(device=device, dtype=dtype)
        else:
            q, scale = quantize_fp8(tensor)
            out[f"{module}.scales"] = scale.reshape(1, -1).to(device)
        out[f"{module}.qweight"] = q.to(device)
    return out


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, each shared tensor (a tied embedding) counted once, plus the weights
    packed for oneDNN (serving.engine.kernels.cpu_linear), which are neither."""
    seen: set[int] = set()
    total = sum(int(getattr(m, "weight_nbytes", 0)) for m in model.modules())
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total
