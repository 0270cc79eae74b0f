from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.ops.cli.main import main
from serving.engine.benchmark import run_engine_benchmark


def test_engine_benchmark_measures_engine_and_transformers(llama_dir: Path) -> None:
    report = run_engine_benchmark(llama_dir, [1, 2], output_len=4, threads=1, baselines=True, repeats=1)
    systems = {(r.system, r.concurrency) for r in report.results if r.tokens_per_s > 0}
    assert {("engine", 1), ("engine", 2), ("hf_generate", 1), ("hf_generate_padded", 2)} <= systems
    assert all(r.output_tokens == 4 * r.concurrency for r in report.results if r.tokens_per_s > 0)
    assert "engine_c1_over_hf_generate_b1" in report.ratios and "engine_c2_over_engine_c1" in report.ratios


def test_bench_engine_command_prints_json_and_a_table(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    code = main(["bench", "engine", "--model", str(llama_dir), "--concurrency", "1,2", "--output-len", "3",
                 "--no-baselines", "--repeats", "2", "--json-out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "engine" in printed and "c=2" in printed
    assert json.loads(out.read_text())["results"][1]["concurrency"] == 2
