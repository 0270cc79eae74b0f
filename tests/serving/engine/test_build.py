"""The build step: load sizes the KV cache and builds the speculator; tune takes every start-up decision and
returns them as the start-up line's rows, in its order."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from serving.engine import huge_pages
from serving.engine.build import compiles, kv_budget_bytes, load, tune
from serving.engine.config import EngineConfig, SpeculativeConfig
from serving.engine.engine import LLMEngine

# explicit where `auto` would measure: these tests are about which decisions are taken and in what order
PLAIN = {"num_threads": 1, "kv_cache_bytes": 4 * 2**20, "cpu_weight_packing": "off", "cpu_decode_attention": "off",
         "compile": "off"}


def _config(model_dir: Path, **overrides: Any) -> EngineConfig:
    return EngineConfig(model=str(model_dir), **{**PLAIN, **overrides})


def test_tune_decides_the_target_alone_without_a_proposer(llama_dir: Path) -> None:
    config = _config(llama_dir)
    runner, tokenizer, why_dtype = load(config)
    assert tokenizer is None and runner.speculator is None and runner.compiled is None
    decisions = tune(runner, config, why_dtype)
    assert [key for key, _, _ in decisions] == [
        "model.dtype", "model.num_threads", "model.cpu_huge_pages", "oneDNN primitive caches", "model.compile",
        "model.cpu_weight_packing[target]", "model.cpu_decode_attention[target]"]
    assert decisions[0] == ("model.dtype", "float32", why_dtype)
    assert decisions[1] == ("model.num_threads", "1", "model.num_threads is 1")
    assert decisions[2][2].startswith(huge_pages.current().reason)  # decided before torch loaded, by the entry point
    assert decisions[3] == ("oneDNN primitive caches", *runner.primitive_caches)
    assert decisions[4] == ("model.compile", "off", "model.compile is off on cpu")
    assert decisions[5] == ("model.cpu_weight_packing[target]", "dense", "model.cpu_weight_packing is off")
    assert decisions[6] == ("model.cpu_decode_attention[target]", "gather + SDPA", "model.cpu_decode_attention is off")
    assert [d.model for d in runner.weight_packing] == ["target"] and runner.draft_rollout is None


def test_tune_takes_the_drafts_decisions_through_its_hooks(llama_dir: Path) -> None:
    spec = SpeculativeConfig(enabled=True, method="draft", draft_model=str(llama_dir), num_draft_tokens=3,
                             draft_rollout="off", draft_token_map=None)
    config = _config(llama_dir, speculative=spec)
    runner, _, why_dtype = load(config)
    decisions = tune(runner, config, why_dtype)
    assert [key for key, _, _ in decisions] == [
        "model.dtype", "model.num_threads", "model.cpu_huge_pages", "oneDNN primitive caches", "model.compile",
        "model.cpu_weight_packing[target]", "model.cpu_weight_packing[draft]",
        "model.cpu_decode_attention[target]", "model.cpu_decode_attention[draft]",
        "speculative", "speculative.draft_token_map", "speculative.draft_context", "speculative.draft_rollout"]
    assert decisions[9:] == [
        ("speculative", "draft, k <= 3", "adaptive: k per step from measured costs"),
        ("speculative.draft_token_map", "none", "speculative.draft_token_map is none"),
        ("speculative.draft_context", "whole sequence", "auto: the draft's max_position_embeddings (512) covers the "
                                                        "context (512)"),
        ("speculative.draft_rollout", "off", "speculative.draft_rollout is off")]
    assert [d.model for d in runner.weight_packing] == ["target", "draft"]
    assert [d.model for d in runner.decode_attention] == ["target", "draft"]
    assert runner.draft_rollout is not None and not runner.draft_rollout.enabled


def test_an_ngram_proposer_adds_only_the_speculative_row(llama_dir: Path) -> None:
    config = _config(llama_dir, speculative=SpeculativeConfig(enabled=True, method="ngram", adaptive=False))
    runner, _, why_dtype = load(config)
    decisions = tune(runner, config, why_dtype)
    assert decisions[-1] == ("speculative", "ngram, k <= 12", "k at every step")
    assert [key for key, _, _ in decisions].count("model.cpu_weight_packing[target]") == 1
    assert runner.draft_rollout is None and len(runner.weight_packing) == len(runner.decode_attention) == 1


def test_from_config_logs_tunes_decisions_on_one_line(llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="serving.engine.engine"):
        engine = LLMEngine.from_config(_config(llama_dir))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up decisions: ")]
    assert line == "start-up decisions: " + "; ".join(f"{key} {value} ({why})"
                                                      for key, value, why in engine.startup_decisions)
    assert engine.blocks.num_blocks == engine.runner.cache.num_blocks


@pytest.mark.parametrize(("mode", "device", "expected"), [
    ("auto", "cuda", True), ("auto", "cpu", False), ("on", "cpu", True), ("off", "cuda", False),
])
def test_compile_mode(mode: str, device: str, expected: bool) -> None:
    assert compiles(mode, torch.device(device)) is expected


def test_the_kv_budget_is_the_configured_bytes_or_the_cpu_default(llama_dir: Path) -> None:
    assert kv_budget_bytes(_config(llama_dir), torch.device("cpu")) == 4 * 2**20
    assert kv_budget_bytes(_config(llama_dir, kv_cache_bytes=None), torch.device("cpu")) == 256 * 2**20
