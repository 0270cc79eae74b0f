"""Matmul weights packed for oneDNN on CPU (`model.cpu_weight_packing`).

`nn.Linear` on CPU multiplies with MKL's sgemm against the transposed weight, and for the short, wide
activations of decoding its time grows almost linearly with the rows from the first row on: a verify step
of 9 tokens costs ~4.5x a 1-token step in the matmuls, although the weights are read once either way. Packing
reorders each weight once, at load, into oneDNN's blocked layout and multiplies with
`torch.ops.mkldnn._linear_pointwise` (what inductor's CPU freezing pass emits). Measured here (2-core AMD
EPYC, one thread, the demo target's four matmuls of a layer plus its lm_head, weights hot in cache):

    rows                     1     2     4     9    16    32    64
    aten::linear (µs)      116   207   388   525   710 1,399 2,525
    packed (µs)            138   137   140   206   301   541 1,006

So packing wins from two rows on (2.5x at 9-64 rows), and costs ~20 % at one row when the weights sit in
cache (a small model, e.g. a draft). When they do not (the demo target's 28 MB streams from memory every
step) the packed one-row step was faster too. Hence per model, measured:

- `auto` (default): on CPU, for the target and the draft each, a one-token step and a 16-token step (a
  verify, or a batch of decodes) are timed with dense and with packed weights (7 interleaved rounds, 3 once
  that has taken 5 s). Each layout's worse shape is taken against the best time of that shape, and packed is
  kept unless its worse shape is more than 3 % further from the best than dense's. Timed at one token alone,
  a busy moment of a shared machine flipped the choice between runs (the two are within a few % there) and
  threw away the 2x of every multi-row step. Both copies of the weights exist only during that measurement.
- `on`: pack on CPU without measuring. `off`: never.

Packing applies only where it can: CPU, fp32 (or bf16 where oneDNN supports it), no quantization, no tensor
parallelism, and not under `model.compile: on` (inductor cannot lower `_linear_pointwise` on an already packed
weight). The product differs from `nn.Linear`'s only in fp32 summation order (a few 1e-6 relative). Spec-off,
draft and verify steps of an engine all run the same packed weights, so drafts are checked against the logits
the engine would sample from anyway; greedy outputs with spec off, draft and n-gram were identical in every
bench run (docs/benchmarks/log.md).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

import torch
from torch import nn

from serving.config import WeightPacking
from serving.engine.model import Transformer
from serving.engine.timing import forward_seconds, interleaved_medians

log = logging.getLogger(__name__)

ROWS_HINT = 32  # the batch size oneDNN blocks the packed weight for (the best of 1-64 at every row count, measured)
_ROUNDS = 7  # interleaved timing rounds in `auto`...
_MIN_ROUNDS, _BUDGET_S = 3, 5.0  # ...but no more than 3 once the measurement has taken this long (large models)
_TOLERANCE = 1.03  # packed is kept unless its worse shape is this much further from the best than dense's
WIDE_STEP = 16  # tokens of the multi-row step timed beside the one-token step


@dataclass
class PackingDecision:
    model: str  # "target" or "draft"
    packed: bool
    reason: str  # why (measured times, or why packing does not apply)
    dense_step_ms: float | None = None  # one-token decode step, median of the rounds (auto only)
    packed_step_ms: float | None = None
    dense_wide_ms: float | None = None  # a WIDE_STEP-token step, likewise
    packed_wide_ms: float | None = None


class PackedLinear(nn.Module):
    """y = x W^T + b with W reordered once into oneDNN's blocked layout (an opaque mkldnn tensor)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)
        self.bias = bias
        # an opaque mkldnn tensor is neither a parameter nor a buffer: its size is kept for weight accounting
        self.weight_nbytes = weight.numel() * weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed_weight, self.bias,
                                                 "none", [], "")
        return out.view(*lead, self.out_features)


def unsupported_reason(device: torch.device, dtype: torch.dtype, quantization: str, compiled: bool,
                       tensor_parallel: bool) -> str | None:
    """Why packing cannot apply to a model loaded this way; None when it can."""
    if device.type != "cpu":
        return f"device {device.type}: packing is for CPU"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if quantization != "none":
        return f"quantization {quantization}: the quantized matmuls are used as they are"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no oneDNN bf16 support"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype}: packing supports fp32 and bf16"
    if compiled:
        return "model.compile is on: inductor chooses the matmuls of compiled steps"
    if tensor_parallel:
        return "tensor parallelism: ranks keep their plain sharded weights"
    return None


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) of every nn.Linear of the model."""
    found: list[tuple[nn.Module, str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            parent, _, child = name.rpartition(".")
            found.append((model.get_submodule(parent) if parent else model, child, module))
    return found


def pack(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Replace every nn.Linear of the model by a PackedLinear; returns the (parent, attribute, Linear) replaced."""
    replaced = _linears(model)
    for parent, child, linear in replaced:
        assert isinstance(linear, nn.Linear)
        setattr(parent, child, PackedLinear(linear.weight, linear.bias))
    return replaced


def _swap(slots: list[tuple[nn.Module, str, nn.Module]]) -> list[tuple[nn.Module, str, nn.Module]]:
    """Put each given module in its slot; returns the modules that were there (to swap back)."""
    previous = [(parent, child, getattr(parent, child)) for parent, child, _ in slots]
    for parent, child, module in slots:
        setattr(parent, child, module)
    return previous


def choose(model: Transformer, name: str, mode: WeightPacking, reason_not: str | None) -> PackingDecision:
    """Pack the model's matmul weights or not, as `mode` says (see the module docstring); returns the decision."""
    if mode == "off":
        return PackingDecision(name, False, "model.cpu_weight_packing is off")
    if reason_not is not None:
        return PackingDecision(name, False, reason_not)
    if mode == "on":
        pack(model)
        return PackingDecision(name, True, "model.cpu_weight_packing is on")
    context = max(min(128, model.max_model_len - WIDE_STEP - 1), 0)  # cached tokens before the timed ones
    forward_seconds(model, context, 1, repeats=3)  # warm-up, dense
    dense_modules = pack(model)
    forward_seconds(model, context, 1, repeats=3)  # warm-up, packed (oneDNN makes its primitive once)
    forward_seconds(model, context, WIDE_STEP, repeats=1)
    timings: dict[str, list[float]] = {"packed": [], "dense": []}

    def steps(layout: str) -> float:
        narrow = forward_seconds(model, context, 1, repeats=5)
        timings[layout].append(forward_seconds(model, context, WIDE_STEP, repeats=2))
        return narrow

    def dense_steps() -> float:  # the dense weights in for one timing, then the packed ones back
        nonlocal dense_modules
        packed_modules = _swap(dense_modules)
        seconds = steps("dense")
        dense_modules = _swap(packed_modules)
        return seconds

    p, d = interleaved_medians([lambda: steps("packed"), dense_steps], _ROUNDS, _MIN_ROUNDS, _BUDGET_S)
    pw, dw = (statistics.median(timings[k]) for k in ("packed", "dense"))
    best, best_wide = min(p, d), min(pw, dw)
    keep = max(p / best, pw / best_wide) <= max(d / best, dw / best_wide) * _TOLERANCE
    if not keep:
        _swap(dense_modules)
    decision = PackingDecision(name, keep, f"1-/{WIDE_STEP}-token steps {p * 1e3:.2f}/{pw * 1e3:.2f} ms packed vs "
                                           f"{d * 1e3:.2f}/{dw * 1e3:.2f} ms dense", d * 1e3, p * 1e3, dw * 1e3,
                               pw * 1e3)
    log.info("cpu weight packing, %s: %s (%s)", name, "packed" if keep else "dense", decision.reason)
    return decision
