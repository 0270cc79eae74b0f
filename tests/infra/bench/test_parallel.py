"""`python -m infra.bench.parallel`: decode tokens/s of the demo target per tensor-parallel size (gloo ranks),
each as a ratio to the first (figures not asserted)."""

from __future__ import annotations

import pytest

from infra.bench.parallel import main as tp_benchmark

pytestmark = pytest.mark.slow


def test_benchmark_reports_each_tp_against_the_first(capsys: pytest.CaptureFixture[str]) -> None:
    from serving.demo import target_path

    assert tp_benchmark(["--model", str(target_path()), "--tp", "1", "2", "--concurrency", "2",
                         "--output-len", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "tp=1" in lines[1] and "(1.00x tp=1)" in lines[1]
    assert "tp=2" in lines[2] and "tok/s" in lines[2]
