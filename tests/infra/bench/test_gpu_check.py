"""The prepared GPU check (infra.bench.gpu_check): its arithmetic, table and arguments, and a dry run of the
whole script on a tiny model on CPU, so that it is known to run before a card is lent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from infra.bench import gpu_check
from infra.bench.gpu_check import LLAMA3_8B, ONE_B, TINY, Row


def test_shapes_are_llama3_8b_and_tinyllama() -> None:
    assert gpu_check.parameter_count(LLAMA3_8B) == 8_030_261_248  # Meta-Llama-3-8B's published count
    assert gpu_check.parameter_count(ONE_B) == 1_100_048_384  # TinyLlama-1.1B's
    args = gpu_check.model_args(LLAMA3_8B)
    assert (args.n_heads, args.n_kv_heads, args.head_dim, args.rope["rope_theta"]) == (32, 8, 128, 500000.0)


def test_kv_read_and_bound_arithmetic() -> None:
    # Llama-3-8B in bf16: K and V of 32 layers x 8 heads x 128 dims = 128 KiB per cached token
    assert gpu_check.kv_bytes_read(LLAMA3_8B, [1], 2) == 131072
    assert gpu_check.kv_bytes_read(LLAMA3_8B, [100, 28], 2) == 128 * 131072
    # batch 1: the weights alone (the yardstick); batch > 1: plus every sequence's K/V
    assert gpu_check.bound_step_s(16 * 10**9, 10**9, 1, 4e12) == pytest.approx(4e-3)
    assert gpu_check.bound_step_s(16 * 10**9, 10**9, 16, 4e12) == pytest.approx(4.25e-3)
    row = Row("8b", "captured", 1, 128, step_ms=5.0, forward_ms=4.5, bound_step_ms=4.0)
    assert row.fraction_of_bound == pytest.approx(0.8)
    assert row.forward_fraction_of_bound == pytest.approx(4.0 / 4.5)
    assert Row("8b", "eager", 1, 128).fraction_of_bound is None


def test_context_mix_cycles() -> None:
    assert gpu_check.batch_contexts(1) == [128]
    assert gpu_check.batch_contexts(6) == [128, 512, 1024, 2048, 128, 512]
    assert sum(gpu_check.batch_contexts(64)) == 16 * (128 + 512 + 1024 + 2048)


def test_random_model_and_the_weight_bytes_a_step_reads() -> None:
    model = gpu_check.build_random_model(TINY, torch.float32, torch.device("cpu"), 64)
    assert model.layers[0].attention_norm.weight.eq(1).all()
    assert 0.015 < model.layers[0].attention.wqkv.weight.std().item() < 0.025
    table = TINY["vocab_size"] * TINY["hidden_size"]
    assert gpu_check.step_weight_bytes(model) == 4 * (gpu_check.parameter_count(TINY) - table)


def test_table_has_one_row_per_measurement_and_dashes_for_what_is_missing() -> None:
    rows = [Row("8b", "captured", 1, 128, tokens_per_s=200.0, step_ms=5.0, forward_ms=4.5, bound_step_ms=4.0,
                kernels_per_step=612, verify_ratio={4: 1.02, 8: 1.05, 12: 1.1}),
            Row("8b", "triton", 64, 928, note="skipped: over the time budget")]
    table = gpu_check.format_table(rows, "H100, copy bandwidth 3000 GB/s", [4, 8, 12]).splitlines()
    assert table[0] == "H100, copy bandwidth 3000 GB/s"
    assert "verify/decode k=4/8/12" in table[2]
    assert table[4] == "| 8b | captured | 1 | 128 | 200.0 | 5.00 | 4.50 | 80.0 | 88.9 | 612 | 1.02/1.05/1.10 |  |"
    assert table[5] == "| 8b | triton | 64 | 928 | - | - | - | - | - | - | - | skipped: over the time budget |"
    assert len(table) == 6


def test_arguments() -> None:
    plan, path = gpu_check.parse_args([])
    assert (plan.models, plan.batches, plan.ks) == (["8b", "1b"], [1, 16, 64], [4, 8, 12])
    assert plan.modes == ["captured", "captured+triton", "eager", "eager+triton"]  # the budget skips the last first
    assert plan.device == "cuda" and plan.dtype == torch.bfloat16 and path is None
    plan, path = gpu_check.parse_args(["--models", "1b", "--modes", "captured", "--batches", "1", "--json", "x.json"])
    assert (plan.models, plan.modes, plan.batches, path) == (["1b"], ["captured"], [1], Path("x.json"))
    plan, _ = gpu_check.parse_args(["--dry-run"])
    assert (plan.models, plan.device, plan.batches, plan.ks) == (["tiny"], "cpu", [1, 2], [4])
    for bad in (["--models", "70b"], ["--modes", "graphs"], ["--batches", "1,x"], ["--ks", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            gpu_check.parse_args(bad)
        assert exit_info.value.code == 2


def test_only_the_buckets_the_rows_use_are_captured() -> None:
    plan, _ = gpu_check.parse_args([])
    # verify: batch 1 at k + 1 = 5, 9, 13 tokens -> buckets 8 and 16; batch 16 at 80, 144, 208 -> 128 and 256
    assert gpu_check.capture_buckets(plan) == ([8, 16, 128, 256], [1, 16, 64])
    plan, _ = gpu_check.parse_args(["--batches", "1", "--ks", "4"])
    assert gpu_check.capture_buckets(plan) == ([8], [1])


def test_without_a_gpu_the_check_refuses_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert gpu_check.main(["--models", "tiny"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_dry_run_on_cpu_prints_one_table_and_writes_json(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Every mode's code runs: captured (piecewise graphs traced with the eager backend on CPU) and eager are
    measured; the Triton modes are refused on CPU, and their rows say why."""
    out = tmp_path / "check.json"
    # the check runs in a process of its own; here, earlier tests' compiled steps would count against dynamo's
    # recompile limit for the code all CompiledForwards share (test_compile.py does the same)
    torch._dynamo.reset()
    assert gpu_check.main(["--dry-run", "--json", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("| model |") for line in printed) == 1
    assert len([line for line in printed if line.startswith("| tiny |")]) == 8  # 4 modes x batches 1, 2
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["params"] == {"tiny": gpu_check.parameter_count(TINY)}
    rows = {(row["mode"], row["batch"]): row for row in result["rows"]}
    assert len(rows) == 8
    for mode in ("captured", "eager"):
        for batch in (1, 2):
            row = rows[mode, batch]
            assert row["tokens_per_s"] is not None, row["note"]  # a mode that failed says why in its note
            assert row["tokens_per_s"] > 0 and row["step_ms"] > 0 and row["forward_ms"] > 0, row
            assert row["fraction_of_bound"] > 0 and row["kernels_per_step"] is None  # no kernels to count on CPU
        assert set(rows[mode, 1]["verify_ratio"]) == {"4"} and rows[mode, 2]["verify_ratio"] == {}
        assert rows[mode, 2]["bound_step_ms"] > rows[mode, 1]["bound_step_ms"]  # batch 2 adds its sequences' K/V
    assert rows["captured", 1]["note"].startswith("1 piecewise + 0 decode graphs")
    for mode in ("captured+triton", "eager+triton"):
        assert rows[mode, 1]["step_ms"] is None and "CUDA only" in rows[mode, 1]["note"]
