from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.bench.prefix import run_prefix_benchmark
from infra.ops.cli.main import main


def test_prefix_benchmark_skips_the_shared_prompt_with_caching_on(llama_dir: Path) -> None:
    report = run_prefix_benchmark(llama_dir, requests=4, concurrency=2, system_tokens=96, output_len=4)
    off, on = report.runs
    assert not off.prefix_caching and on.prefix_caching
    # the first two requests arrive together and both compute the 96-token system prompt (6 full blocks);
    # the two that follow find it cached and compute only their own turn
    assert off.prompt_tokens_computed == sum(96 + u for u in report.user_tokens)
    assert on.prompt_tokens_computed == off.prompt_tokens_computed - 2 * 96
    assert off.prefix_cache_hit_rate == 0.0
    assert on.prefix_cache_hit_rate == pytest.approx(2 * 96 / off.prompt_tokens_computed)
    assert report.outputs_identical
    assert report.ttft_p50_on_over_off == pytest.approx(on.ttft_p50_s / off.ttft_p50_s)


def test_prefix_benchmark_refuses_a_prompt_longer_than_the_context(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="exceeds the model's context of 512"):
        run_prefix_benchmark(llama_dir, requests=1, system_tokens=500, output_len=4)


def test_bench_prefix_command_prints_json_and_a_table(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    code = main(["bench", "prefix", "--model", str(llama_dir), "--system-tokens", "64", "--requests", "3",
                 "--output-len", "3", "--json-out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "TTFT P50 on / off" in printed and "identical with prefix caching on and off: True" in printed
    assert json.loads(out.read_text())["system_prompt_tokens"] == 64


def test_bench_prefix_command_names_a_bad_flag(llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "prefix", "--model", str(llama_dir), "--requests", "0"]) != 0
    assert "--requests must be a positive integer" in capsys.readouterr().err


def test_bench_prefix_passes_weight_packing_and_decode_attention_to_both_engines(tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    code = main(["bench", "prefix", "--system-tokens", "64", "--requests", "2", "--output-len", "2",
                 "--cpu-weight-packing", "on", "--cpu-decode-attention", "off", "--json-out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert [(d["model"], d["packed"]) for d in report["weight_packing"]] == [("target", True)]
    assert [(d["model"], d["kernel"]) for d in report["decode_attention"]] == [("target", False)]
    assert report["outputs_identical"] is True
