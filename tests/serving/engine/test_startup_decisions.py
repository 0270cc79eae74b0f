"""The defaults the engine decides by itself at start-up: each is taken, logged with its reason, and an explicit
setting always wins (model.dtype, model.num_threads, speculative.draft_token_map)."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from serving.config import ModelSection, ServerConfig, SpeculativeSection
from serving.engine import cpu_threads
from serving.engine.config import EngineConfig, SpeculativeConfig
from serving.engine.loader import dtype_reason, read_model_args, resolve_dtype
from serving.engine.spec.token_map import resolve
from serving.weights import build_manifest
from serving.weights.manifest import MANIFEST_NAME

# ---- the server config's defaults -------------------------------------------------------------------------


def test_a_plain_config_leaves_every_decision_to_the_engine() -> None:
    config = ServerConfig(model=ModelSection(path="/m"), speculative=SpeculativeSection(
        enabled=True, method="draft", draft_model="/d"))
    assert config.model.dtype == "auto" and config.model.num_threads == "auto"
    assert config.speculative.num_draft_tokens == 12 and config.speculative.draft_token_map == "auto"
    engine = EngineConfig.from_server_config(config)
    assert (engine.dtype, engine.num_threads, engine.speculative.draft_token_map) == ("auto", "auto", "auto")


@pytest.mark.parametrize("value", [None, "none", "None"])
def test_none_turns_the_token_map_off(value: str | None) -> None:
    assert SpeculativeSection(draft_token_map=value).draft_token_map is None


def test_num_threads_takes_a_count_or_auto_and_names_a_bad_value() -> None:
    assert ModelSection(path="/m", num_threads=3).num_threads == 3
    with pytest.raises(ValueError, match="num_threads"):
        ModelSection(path="/m", num_threads=0)
    with pytest.raises(ValueError, match="num_threads"):
        ModelSection(path="/m", num_threads="all")


# ---- model.dtype ---------------------------------------------------------------------------------------------


def test_dtype_auto_is_fp32_on_cpu_and_the_checkpoints_on_cuda(llama_dir: Path, tmp_path: Path) -> None:
    args = read_model_args(llama_dir)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
    assert resolve_dtype("auto", args, cpu) == torch.float32
    assert "fp32 on CPU" in dtype_reason("auto", args, cpu)
    named = tmp_path / "fp16"
    shutil.copytree(llama_dir, named)
    config = json.loads((named / "config.json").read_text())
    (named / "config.json").write_text(json.dumps({**{k: v for k, v in config.items() if k != "dtype"},
                                                   "torch_dtype": "float16"}))
    assert resolve_dtype("auto", read_model_args(named), cuda) == torch.float16
    assert "torch_dtype float16" in dtype_reason("auto", read_model_args(named), cuda)
    unnamed_config = {k: v for k, v in config.items() if k not in ("torch_dtype", "dtype")}
    (named / "config.json").write_text(json.dumps(unnamed_config))
    unnamed = read_model_args(named)
    assert resolve_dtype("auto", unnamed, cuda) == torch.bfloat16
    assert "names no torch_dtype" in dtype_reason("auto", unnamed, cuda)


def test_an_explicit_dtype_wins_on_every_device(llama_dir: Path) -> None:
    args = read_model_args(llama_dir)
    for device in (torch.device("cpu"), torch.device("cuda")):
        assert resolve_dtype("bf16", args, device) == torch.bfloat16
        assert dtype_reason("bf16", args, device) == "model.dtype is bf16"


# ---- model.num_threads ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cores, expected", [(1, [1]), (2, [1]), (3, [1, 2]), (4, [1, 2, 3]), (16, [1, 2, 4, 8, 15])])
def test_auto_keeps_a_core_for_the_server_and_measures_the_rest(cores: int, expected: list[int]) -> None:
    assert cpu_threads.candidates(cores) == expected


@pytest.mark.parametrize("files, expected", [
    ({"cpu.max": "150000 100000\n"}, 1.5),  # cgroup v2: --cpus 1.5
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),
])
def test_a_cpu_quota_caps_the_usable_cores(tmp_path: Path, files: dict[str, str], expected: float | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_threads.cpu_quota(tmp_path) == expected
    affinity = len(os.sched_getaffinity(0))
    assert cpu_threads.usable_cores(tmp_path) == (min(affinity, math.ceil(expected)) if expected else affinity)


@pytest.fixture
def threads_restored(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_two_cores_give_the_engine_one_thread_without_measuring(kit: Any, llama_dir: Path,
                                                              threads_restored: None) -> None:
    model = kit.make_engine(llama_dir).model
    torch.set_num_threads(2)
    decision = cpu_threads.choose(model, "auto", cores=2)
    assert decision.threads == 1 and torch.get_num_threads() == 1 and decision.step_ms is None
    assert "one kept for the HTTP server" in decision.reason


def test_more_cores_are_measured_and_the_choice_is_among_the_candidates(kit: Any, llama_dir: Path,
                                                                       threads_restored: None) -> None:
    model = kit.make_engine(llama_dir).model
    decision = cpu_threads.choose(model, "auto", cores=4)
    assert decision.step_ms is not None and sorted(decision.step_ms) == [1, 2, 3]
    assert decision.threads in (1, 2, 3) and torch.get_num_threads() == decision.threads
    assert "1-/16-token steps by threads 1:" in decision.reason


def test_an_explicit_count_and_then_omp_num_threads_win(kit: Any, llama_dir: Path, threads_restored: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    model = kit.make_engine(llama_dir).model
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads.choose(model, 1).reason == "model.num_threads is 1" and torch.get_num_threads() == 1
    decision = cpu_threads.choose(model, "auto", cores=16)
    assert decision.threads == 2 and decision.reason == "OMP_NUM_THREADS=2 in the environment"


def test_cuda_leaves_the_host_threads_alone(threads_restored: None) -> None:
    class OnCuda:
        device = torch.device("cuda")

    torch.set_num_threads(2)
    decision = cpu_threads.choose(OnCuda(), "auto")  # type: ignore[arg-type]
    assert decision.threads is None and "cuda" in decision.reason and torch.get_num_threads() == 2


# ---- speculative.draft_token_map -----------------------------------------------------------------------------


def _draft(tmp_path: Path, llama_dir: Path, token_map: bool, manifest: str | None) -> Path:
    """A draft directory: with or without token_map.json, and a manifest that lists it ("listed"), leaves it out
    ("unlisted"), or none."""
    draft = tmp_path / "draft"
    shutil.copytree(llama_dir, draft)
    if token_map:
        (draft / "token_map.json").write_text(json.dumps(list(range(0, 128, 2))))
    if manifest is not None:
        saved = (draft / "token_map.json").read_bytes() if manifest == "unlisted" and token_map else None
        if saved is not None:
            (draft / "token_map.json").unlink()
        (draft / MANIFEST_NAME).write_text(build_manifest(draft).to_json())
        if saved is not None:
            (draft / "token_map.json").write_bytes(saved)
    return draft


@pytest.mark.parametrize("token_map, manifest, setting, expected, reason", [
    (True, "listed", "auto", "token_map.json", "listed in the draft's manifest.json"),
    (True, None, "auto", "token_map.json", "no manifest.json to check it against"),
    (True, "unlisted", "auto", None, "not in its manifest.json, so it was not verified with the weights"),
    (False, "listed", "auto", None, "has no token_map.json"),
    (True, "listed", None, None, "is none"),
    (True, "unlisted", "token_map.json", "token_map.json", "names it"),  # explicit wins
])
def test_the_token_map_decision_and_its_reason(tmp_path: Path, llama_dir: Path, token_map: bool,
                                               manifest: str | None, setting: str | None, expected: str | None,
                                               reason: str) -> None:
    chosen, why = resolve(_draft(tmp_path, llama_dir, token_map, manifest), setting)
    assert chosen == expected and reason in why


def test_an_unreadable_manifest_refuses_the_map_and_says_why(tmp_path: Path, llama_dir: Path) -> None:
    draft = _draft(tmp_path, llama_dir, True, None)
    (draft / MANIFEST_NAME).write_text("{not json")
    chosen, why = resolve(draft, "auto")
    assert chosen is None and "cannot be read" in why


# ---- the start-up line ---------------------------------------------------------------------------------------


def test_one_start_up_line_lists_every_decision(kit: Any, llama_dir: Path, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture, threads_restored: None) -> None:
    draft = _draft(tmp_path, llama_dir, True, "listed")
    with caplog.at_level(logging.INFO, logger="serving.engine.engine"):
        engine = kit.make_engine(llama_dir, speculative=SpeculativeConfig(enabled=True, method="draft",
                                                                          draft_model=str(draft)))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up decisions: ")]
    assert len(lines) == 1
    line = lines[0]
    for setting in ("model.dtype float32 (auto: fp32 on CPU", "model.num_threads ", "model.cpu_huge_pages ",
                    "oneDNN primitive caches ",
                    "model.compile off", "model.cpu_weight_packing[target]", "model.cpu_decode_attention[target]",
                    "speculative draft, k <= 12", "speculative.draft_token_map token_map.json (auto: token_map.json, "
                    "listed in the draft's manifest.json)", "speculative.draft_rollout off"):
        assert setting in line, setting
    assert engine.speculator is not None and engine.speculator.proposer.token_map_size == 64  # type: ignore[attr-defined]
