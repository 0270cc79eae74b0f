from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

from infra.bench.engine import run_engine_benchmark
from infra.bench.step_profile import StepTimer
from infra.ops.cli.main import main
from serving.engine.types import SamplingParams


@pytest.mark.slow  # benchmark-shaped: runs transformers' baselines too
def test_engine_benchmark_measures_engine_and_transformers(llama_dir: Path) -> None:
    report = run_engine_benchmark(llama_dir, [1, 2], output_len=4, threads=1, baselines=True, repeats=1)
    systems = {(r.system, r.concurrency) for r in report.results if r.tokens_per_s > 0}
    assert {("engine", 1), ("engine", 2), ("hf_generate", 1), ("hf_generate_padded", 2)} <= systems
    assert all(r.output_tokens == 4 * r.concurrency for r in report.results if r.tokens_per_s > 0)
    assert "engine_c1_over_hf_generate_b1" in report.ratios and "engine_c2_over_engine_c1" in report.ratios
    assert [b.concurrency for b in report.breakdown] == [1, 2]
    for b in report.breakdown:
        assert b.steps >= 4 and b.python_ms > 0 and b.attention_ms > 0 and b.matmuls_ms > 0 and b.sampling_ms > 0
        parts = b.python_ms + b.attention_ms + b.matmuls_ms + b.sampling_ms + b.drafting_ms
        assert parts == pytest.approx(b.step_ms, rel=1e-6)


def test_step_timer_splits_a_step_and_leaves_the_engine_as_it_was(llama_dir: Path, kit: Any) -> None:
    engine = kit.make_engine(llama_dir)
    prompts = kit.random_prompts([20, 9])
    run = functools.partial(kit.run_to_completion, engine, prompts, [SamplingParams(temperature=0.0, max_tokens=5)] * 2)
    plain = run()
    timer = StepTimer(engine)
    with timer:
        assert "step" in vars(engine) and "attend_group" in vars(engine.model.layers[0].attention)
        timed = run()
    assert timed == plain  # timing changes nothing the engine computes
    assert "step" not in vars(engine) and "forward" not in vars(engine.model)
    assert all("attend_group" not in vars(layer.attention) for layer in engine.model.layers)
    b = timer.breakdown(2)
    assert b.steps == 5 and b.step_ms > b.attention_ms > 0 and b.share("python") + b.share("matmuls") < 1


def test_bench_engine_command_prints_json_and_a_table(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    code = main(["bench", "engine", "--model", str(llama_dir), "--concurrency", "1,2", "--output-len", "3",
                 "--no-baselines", "--repeats", "2", "--json-out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "engine" in printed and "c=2" in printed
    assert "step time split" in printed and "python" in printed and "attention" in printed
    assert json.loads(out.read_text())["results"][1]["concurrency"] == 2


@pytest.mark.parametrize("packing", ["on", "off"])
def test_bench_engine_passes_dtype_weight_packing_and_decode_attention_to_the_engine(
    llama_dir: Path, tmp_path: Path, packing: str
) -> None:
    import torch

    out = tmp_path / "report.json"
    code = main(["bench", "engine", "--model", str(llama_dir), "--concurrency", "1", "--output-len", "2",
                 "--no-baselines", "--repeats", "1", "--dtype", "bf16", "--cpu-weight-packing", packing,
                 "--cpu-decode-attention", "off", "--json-out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["dtype"] == "torch.bfloat16"
    (decision,) = report["weight_packing"]
    bf16_packs = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert decision["model"] == "target" and decision["packed"] is (packing == "on" and bf16_packs)
    assert report["decode_attention"] == [{"model": "target", "kernel": False, "gather_ms": None, "kernel_ms": None,
                                           "reason": "model.cpu_decode_attention is off"}]


@pytest.mark.slow
def test_bench_spec_passes_dtype_and_weight_packing_to_every_engine(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`bench spec` on the demo pair, shortened: the flags reach the three engines, and the c=1 passes interleave."""
    out = tmp_path / "spec.json"
    trace = tmp_path / "policy.jsonl"
    code = main(["bench", "spec", "--concurrency", "1", "--output-len", "4", "--prompts", "2", "--no-baselines",
                 "--repeats", "1", "--dtype", "fp32", "--cpu-weight-packing", "on", "--draft-rollout", "off",
                 "--cpu-decode-attention", "on", "--json-out", str(out), "--trace-policy", str(trace)])
    assert code == 0
    report = json.loads(out.read_text())
    choices = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {c["system"] for c in choices} == {"draft", "ngram"}
    assert {c["phase"] for c in choices} >= {"warm-up", "c1-latency", "throughput-c1"}
    assert not (tmp_path / "policy.jsonl.partial").exists()
    packed = {name: [(d["model"], d["packed"]) for d in decisions]
              for name, decisions in report["weight_packing"].items()}
    assert packed == {"spec_off": [("target", True)], "spec_draft": [("target", True), ("draft", True)],
                      "spec_ngram": [("target", True)]}
    in_place = {name: [(d["model"], d["kernel"]) for d in decisions]
                for name, decisions in report["decode_attention"].items()}
    assert in_place == {"spec_off": [("target", True)], "spec_draft": [("target", True), ("draft", True)],
                        "spec_ngram": [("target", True)]}
    assert report["c1_rounds"] == 1 and report["greedy_identical"] is True
    # the demo draft is benched with the token map it ships (speculative.draft_token_map)
    assert report["draft_token_map"] == "token_map.json" and report["draft_token_map_size"] == 1024
    assert {r["system"]: r["requests"] for r in report["c1"]} == {"spec_off": 2, "spec_draft": 2, "spec_ngram": 2}
    assert report["c1_draft_paired_speedup"] > 0
    # per prompt: which ones set the c=1 P99, and how long their rounds were
    assert [(row["prompt"], set(row["seconds"])) for row in report["c1_prompts"]] == [
        (i, {"spec_off", "spec_draft", "spec_ngram"}) for i in range(2)]
    assert all(row["draft_speedup"] > 0 for row in report["c1_prompts"])
    assert "c=1 per prompt" in capsys.readouterr().out
    assert report["draft_rollout"] == {**report["draft_rollout"], "enabled": False,
                                       "reason": "speculative.draft_rollout is off"}
    assert report["draft_rollouts"] == 0
    ceiling = report["ceiling"]  # no rollout: k eager draft steps (bench spec's --k default)
    assert ceiling["draft_rollout_s"] == 0.0
    assert ceiling["drafting_s"] == pytest.approx(report["num_draft_tokens"] * ceiling["draft_step_s"])


def test_bench_spec_refuses_a_trace_file_in_a_missing_directory_before_running(tmp_path: Path,
                                                                                capsys: pytest.CaptureFixture[str]
                                                                                ) -> None:
    code = main(["bench", "spec", "--trace-policy", str(tmp_path / "missing" / "policy.jsonl")])
    assert code != 0
    err = capsys.readouterr().err
    assert "--trace-policy" in err and "does not exist" in err
