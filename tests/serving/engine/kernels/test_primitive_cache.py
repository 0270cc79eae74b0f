"""oneDNN's primitive caches are bounded before the engine's first primitive, unless the operator set them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from serving.engine.kernels import primitive_cache
from serving.engine.kernels.primitive_cache import ENTRIES, VARIABLES


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_cpu_bounds_both_caches_and_says_why(clean_env: pytest.MonkeyPatch) -> None:
    chosen, why = primitive_cache.bound(torch.device("cpu"))
    assert chosen == f"{ENTRIES} entries" and "per row count" in why
    assert all(os.environ[name] == str(ENTRIES) for name in VARIABLES)


def test_the_operators_setting_wins_and_is_named(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("LRU_CACHE_CAPACITY", "512")
    chosen, why = primitive_cache.bound(torch.device("cpu"))
    assert os.environ["LRU_CACHE_CAPACITY"] == "512" and os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ENTRIES)
    assert chosen == f"{ENTRIES} / 512 entries" and why == "LRU_CACHE_CAPACITY=512 from the environment"


def test_cuda_leaves_the_environment_alone(clean_env: pytest.MonkeyPatch) -> None:
    chosen, why = primitive_cache.bound(torch.device("cuda"))
    assert chosen == "unbounded" and "oneDNN" in why
    assert not any(name in os.environ for name in VARIABLES)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_a_bounded_process_stops_growing_with_new_row_counts() -> None:
    """The behaviour behind the bound, in a fresh process (the capacity is read once per process): packed
    matmuls at new row counts grow resident memory by a primitive per row count, unbounded; bounded, the
    growth stops once the bound's worth is held."""
    script = textwrap.dedent("""
        import sys, torch
        if sys.argv[1] == "bounded":
            from serving.engine.kernels import primitive_cache
            primitive_cache.bound(torch.device("cpu"))
        torch.set_num_threads(1)
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.randn(4096, 256), 32)
        def rss_mib():
            return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
        for rows in range(1, 97):  # warm the allocator and fill a bounded cache
            torch.ops.mkldnn._linear_pointwise(torch.randn(rows, 256), weight, None, "none", [], "")
        before = rss_mib()
        for rows in range(97, 289):
            torch.ops.mkldnn._linear_pointwise(torch.randn(rows, 256), weight, None, "none", [], "")
        print(rss_mib() - before)
    """)
    env = {key: value for key, value in os.environ.items() if key not in VARIABLES}
    env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # glibc's own growth out of the picture: the caches alone
    growth = {mode: float(subprocess.run([sys.executable, "-c", script, mode], env=env, check=True,
                                         capture_output=True, text=True).stdout)
              for mode in ("unbounded", "bounded")}
    if growth["unbounded"] < 8:  # 192 new primitives: ~108 MiB on the AMD EPYC build host
        pytest.skip(f"this oneDNN keeps {growth['unbounded']:.1f} MiB for 192 shapes: nothing worth bounding here")
    assert growth["bounded"] < 0.25 * growth["unbounded"], growth
