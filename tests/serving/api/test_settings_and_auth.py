from __future__ import annotations

from pathlib import Path

import pytest

from serving.api.auth import RateLimiter, find_key
from serving.api.metrics import ServerMetrics
from serving.api.settings import ApiKeyEntry, Settings, parse_api_keys
from serving.api.state import ServerState
from serving.config import ConfigError, ServerConfig
from serving.engine.types import EngineStats

CONFIG = ServerConfig.model_validate({"model": {"path": "/models/x"}, "scheduler": {"max_concurrency": 4,
                                                                                   "request_timeout_s": 10}})
STRONG = "k" * 24


def test_keys_parse_with_ids_and_optional_rate_limits() -> None:
    keys = parse_api_keys(f"a:{STRONG}, b:{STRONG}x:30\n# comment\nc:{STRONG}y", "test")
    assert [(k.key_id, k.requests_per_minute) for k in keys] == [("a", None), ("b", 30), ("c", None)]


def test_malformed_key_entry_names_its_position_not_its_text() -> None:
    with pytest.raises(ConfigError, match="entry 2 is not") as info:
        parse_api_keys(f"a:{STRONG},supersecretwithoutid", "test")
    assert "supersecret" not in str(info.value)


def test_keys_come_from_env_and_mounted_file(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"filekey:{STRONG}f:10\n")
    config = CONFIG.model_copy(update={"service": CONFIG.service.model_copy(update={"api_keys_file": str(key_file)})})
    settings = Settings.from_config(config, {"SPECDEPLOY_API_KEYS": f"envkey:{STRONG}e"})
    assert [k.key_id for k in settings.api_keys] == ["envkey", "filekey"]


def test_production_refuses_no_keys_and_placeholder_keys() -> None:
    with pytest.raises(ConfigError, match="no API keys"):
        Settings.from_config(CONFIG, {})
    with pytest.raises(ConfigError, match="placeholder or shorter") as info:
        Settings.from_config(CONFIG, {"SPECDEPLOY_API_KEYS": "ops:changeme"})
    assert "changeme" not in str(info.value)


def test_development_runs_without_keys() -> None:
    settings = Settings.from_config(CONFIG, {"SPECDEPLOY_ENV": "development"})
    assert not settings.auth_enabled


def test_key_repr_hides_the_secret() -> None:
    assert STRONG not in repr(ApiKeyEntry("a", STRONG))


def test_find_key_matches_only_the_exact_secret() -> None:
    settings = Settings(config=CONFIG, api_keys=(ApiKeyEntry("a", STRONG), ApiKeyEntry("b", STRONG + "b")))
    assert find_key(settings, STRONG + "b") == settings.api_keys[1]
    assert find_key(settings, STRONG[:-1]) is None


def test_rate_limiter_allows_rpm_then_refills() -> None:
    limiter = RateLimiter()
    key = ApiKeyEntry("a", STRONG, requests_per_minute=2)
    assert limiter.acquire(key, now=0.0) == 0.0
    assert limiter.acquire(key, now=0.0) == 0.0
    assert limiter.acquire(key, now=0.0) == pytest.approx(30.0)
    assert limiter.acquire(key, now=30.0) == 0.0


def _stats(running: int, waiting: int) -> EngineStats:
    return EngineStats(num_waiting=waiting, num_running=running, kv_blocks_used=0, kv_blocks_total=10,
                       kv_block_size=16, prompt_tokens_total=0, generation_tokens_total=0, preemptions_total=0,
                       requests_finished_total=0, steps_total=0, step_time_total_s=0.0, last_step_s=0.0,
                       recent_step_durations_s=[])


def test_expected_queue_wait_grows_with_the_queue() -> None:
    state = ServerState(settings=Settings(config=CONFIG), metrics=ServerMetrics(speculative=False))
    assert state.expected_queue_wait_s(_stats(4, 8)) == 0.0  # no measured service time yet
    state.begin_request()
    state.end_request(e2e_s=4.0)
    assert state.expected_queue_wait_s(_stats(2, 0)) == 0.0  # a free slot: no wait
    assert state.expected_queue_wait_s(_stats(4, 11)) == pytest.approx(12.0)  # 3 rounds of 4 s > 10 s timeout


class _BusyEngine:
    """Unit-level stand-in: admits everything, reports a long queue."""

    def check_admission(self, request: object) -> None:
        pass

    def stats(self) -> EngineStats:
        return _stats(4, 11)


def test_admission_refuses_at_once_when_the_expected_wait_exceeds_the_timeout() -> None:
    from serving.api.admit import check_queue_wait
    from serving.api.errors import ApiError

    state = ServerState(settings=Settings(config=CONFIG), metrics=ServerMetrics(speculative=False))
    state.begin_request()
    state.end_request(e2e_s=4.0)
    with pytest.raises(ApiError) as info:
        check_queue_wait(state, _BusyEngine())  # type: ignore[arg-type]
    assert info.value.status == 503
    assert "expected queue wait 12.0s exceeds the request timeout 10s" in info.value.message
    assert info.value.headers()["Retry-After"] == "12"
