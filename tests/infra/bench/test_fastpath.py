"""`python -m infra.bench.fastpath`: its CPU kernel table against gather + SDPA."""

from __future__ import annotations

import pytest
import torch

from infra.bench.fastpath import _BLOCK, _HEAD_DIM, _KERNEL_LAYERS, _KV_HEADS, compare_kernel
from serving.engine.kernels import cpu_attention
from serving.engine.kv_cache import KVCache

pytestmark = pytest.mark.skipif(cpu_attention.find_compiler() is None, reason="no C++ compiler on PATH")


def test_the_fastpath_benchmark_times_the_kernel_against_the_gather_path() -> None:
    """The kernel table: one row per group shape, the two paths agreeing, both for a decode group and for a
    query the engine leaves to SDPA."""
    cache = KVCache(_KERNEL_LAYERS, 64, _BLOCK, _KV_HEADS, _HEAD_DIM, torch.float32, torch.device("cpu"))
    cache.k.normal_()
    cache.v.normal_()
    for queries in (1, 5):
        cells = [c.strip() for c in compare_kernel(cpu_attention.load(), cache, 3, 40, queries, 2).split("|")[1:-1]]
        assert cells[:3] == ["3", "40", str(queries)]
        gather_ms, kernel_ms, ratio, diff = (float(c) for c in cells[3:])
        assert gather_ms >= 0 and kernel_ms >= 0 and ratio > 0  # printed rounded: microseconds at this size
        assert diff < 1e-4
