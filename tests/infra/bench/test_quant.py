"""`specdeploy bench quant`'s held-out perplexity (infra/bench/quant.py), on the demo target in int8."""

from __future__ import annotations

import math

import torch

from infra.bench.quant import heldout_windows, mean_nll
from serving.engine.loader import load_model
from serving.engine.quant import weight_bytes

CPU = torch.device("cpu")


def test_demo_target_int8_keeps_perplexity_and_quarters_the_weights() -> None:
    from serving.demo import target_path

    target = target_path()
    windows = heldout_windows(target, 256, 4)
    assert windows.shape == (4, 257)
    fp32 = load_model(target, torch.float32, CPU, 257)
    int8 = load_model(target, torch.float32, CPU, 257, "int8")
    ppl32, ppl8 = math.exp(mean_nll(fp32, windows)), math.exp(mean_nll(int8, windows))
    assert abs(ppl8 - ppl32) / ppl32 <= 0.02
    assert weight_bytes(int8) <= 0.3 * weight_bytes(fp32)
