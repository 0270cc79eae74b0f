"""The server config file: shape from the guide, strict keys, environment overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.config import ConfigError, load_server_config

GUIDE_EXAMPLE = """
service: {host: 0.0.0.0, port: 8000}
model: {path: /data/models/target, dtype: bf16, max_memory_utilization: 0.85}
scheduler: {max_concurrency: 64, max_input_len: 4096, max_output_len: 1024, max_queue: 128, request_timeout_s: 60}
speculative: {enabled: true, method: draft, draft_model: /data/models/draft, num_draft_tokens: 4, adaptive: true}
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "server.yaml"
    path.write_text(text)
    return path


def test_the_guide_example_loads(tmp_path: Path) -> None:
    config = load_server_config(_write(tmp_path, GUIDE_EXAMPLE), environ={})
    assert config.scheduler.max_concurrency == 64
    assert config.speculative.draft_model == "/data/models/draft"
    assert config.max_model_len == 4096 + 1024


def test_environment_overrides_a_key(tmp_path: Path) -> None:
    path = _write(tmp_path, GUIDE_EXAMPLE)
    config = load_server_config(path, environ={"SPECDEPLOY__SCHEDULER__MAX_QUEUE": "7"})
    assert config.scheduler.max_queue == 7


def test_bad_override_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SPECDEPLOY__QUEUE"):
        load_server_config(_write(tmp_path, GUIDE_EXAMPLE), environ={"SPECDEPLOY__QUEUE": "7"})


def test_unknown_key_is_named(tmp_path: Path) -> None:
    text = GUIDE_EXAMPLE.replace("max_queue: 128", "max_queeu: 128")
    with pytest.raises(ConfigError, match=r"scheduler\.max_queeu: unknown key"):
        load_server_config(_write(tmp_path, text), environ={})


def test_draft_method_requires_a_draft_model(tmp_path: Path) -> None:
    text = GUIDE_EXAMPLE.replace("draft_model: /data/models/draft, ", "")
    with pytest.raises(ConfigError, match="speculative.draft_model is required"):
        load_server_config(_write(tmp_path, text), environ={})


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_server_config(tmp_path / "absent.yaml", environ={})


def test_a_variable_naming_no_key_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"SPECDEPLOY__SCHEDULER__MAX_QUEEU: unknown key scheduler\.max_queeu"):
        load_server_config(_write(tmp_path, GUIDE_EXAMPLE), environ={"SPECDEPLOY__SCHEDULER__MAX_QUEEU": "7"})


def test_a_variable_naming_no_section_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"SPECDEPLOY__SCHEDULAR__MAX_QUEUE: unknown section 'schedular'"):
        load_server_config(_write(tmp_path, GUIDE_EXAMPLE), environ={"SPECDEPLOY__SCHEDULAR__MAX_QUEUE": "7"})


def test_environment_values_are_parsed_and_override_the_file(tmp_path: Path) -> None:
    environ = {
        "SPECDEPLOY__SPECULATIVE__ENABLED": "false",  # the file says true
        "SPECDEPLOY__SERVICE__PORT": "9000",
        "SPECDEPLOY__MODEL__KV_CACHE_BYTES": "4194304",
        "SPECDEPLOY__SPECULATIVE__DRAFT_MODEL": "null",
        "OTHER_VARIABLE": "ignored",
    }
    config = load_server_config(_write(tmp_path, GUIDE_EXAMPLE), environ=environ)
    assert config.speculative.enabled is False and config.speculative.draft_model is None
    assert (config.service.port, config.model.kv_cache_bytes) == (9000, 4194304)
    assert config.scheduler.max_queue == 128  # untouched keys keep the file's value


def test_overridden_values_are_validated_like_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"scheduler\.max_concurrency: Input should be a valid integer"):
        load_server_config(_write(tmp_path, GUIDE_EXAMPLE), environ={"SPECDEPLOY__SCHEDULER__MAX_CONCURRENCY": "x"})


def test_kv_block_size_must_be_a_power_of_two(tmp_path: Path) -> None:
    text = GUIDE_EXAMPLE.replace("max_queue: 128,", "max_queue: 128, kv_block_size: 24,")
    with pytest.raises(ConfigError, match=r"scheduler\.kv_block_size: must be a power of two, got 24"):
        load_server_config(_write(tmp_path, text), environ={})
