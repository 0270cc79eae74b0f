"""One definition per limit: the engine's defaults and bounds are the server config's."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serving.config import ModelSection, ServerConfig, SpeculativeSection
from serving.engine.config import EngineConfig, SpeculativeConfig

# The engine's own settings: the server config has no key for them.
ENGINE_ONLY = {"dtype", "tokenizer", "seed", "num_threads"}


def test_engine_defaults_equal_the_server_configs() -> None:
    from_server = EngineConfig.from_server_config(ServerConfig(model=ModelSection(path="/m")))
    bare = EngineConfig(model="/m")
    shared = set(EngineConfig.model_fields) - ENGINE_ONLY
    assert {f: getattr(bare, f) for f in shared} == {f: getattr(from_server, f) for f in shared}


def test_engine_speculates_with_the_servers_defaults() -> None:
    assert SpeculativeConfig() == SpeculativeSection()
    assert EngineConfig(model="/m").speculative.method == "draft"


def test_engine_bounds_are_the_server_configs() -> None:
    with pytest.raises(ValidationError, match="max_memory_utilization"):
        EngineConfig(model="/m", max_memory_utilization=0.99)  # the server allows at most 0.95
    with pytest.raises(ValidationError, match="max_num_batched_tokens \\(16\\) is below max_num_seqs \\(64\\)"):
        EngineConfig(model="/m", max_num_batched_tokens=16)

