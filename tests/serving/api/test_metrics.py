"""/metrics of a real server exports every series named in serving.metric_names (the names the
alert rules and the dashboard query), and nothing under specdeploy_ that is not named there."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from serving import metric_names

COUNTERS = {metric_names.REQUESTS, metric_names.PROMPT_TOKENS, metric_names.GENERATION_TOKENS,
            metric_names.PREEMPTIONS, metric_names.SPEC_DRAFTS, metric_names.SPEC_DRAFT_TOKENS,
            metric_names.SPEC_ACCEPTED_TOKENS, metric_names.PREFIX_CACHE_QUERIES, metric_names.PREFIX_CACHE_HITS,
            metric_names.STEP_FAILURES, metric_names.SPEC_GUARD_CYCLES, metric_names.SPEC_GUARD_VETOED_CYCLES,
            metric_names.SPEC_GUARD_PLAIN_CYCLES, metric_names.SPEC_GUARD_VETOES}
HISTOGRAMS = {metric_names.TTFT, metric_names.TPOT, metric_names.INTER_TOKEN, metric_names.E2E,
              metric_names.QUEUE_TIME, metric_names.STEP_TIME}
CUDA_ONLY = {metric_names.GPU_MEMORY_USED, metric_names.GPU_MEMORY_TOTAL, metric_names.GPU_UTILIZATION}
SPECULATIVE_ONLY = {metric_names.SPEC_DRAFTS, metric_names.SPEC_DRAFT_TOKENS, metric_names.SPEC_ACCEPTED_TOKENS,
                    metric_names.SPEC_GUARD_CYCLES, metric_names.SPEC_GUARD_VETOED_CYCLES,
                    metric_names.SPEC_GUARD_PLAIN_CYCLES, metric_names.SPEC_GUARD_VETOES}
ALL = {v for k, v in vars(metric_names).items() if k.isupper() and k != "PREFIX" and isinstance(v, str)}


def _exported(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        match = re.match(r"# TYPE (\S+) (\S+)", line)
        if match:  # counters are typed as `<name>_total` or `<name>` depending on the client version
            names.add(match.group(1).removesuffix("_total") if match.group(2) == "counter" else match.group(1))
    return names


def test_every_named_series_is_exported_on_cpu_without_speculation(server: Any) -> None:
    with server.client() as client:
        client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
        text = client.get("/metrics").text
    exported = _exported(text)
    assert ALL - CUDA_ONLY - SPECULATIVE_ONLY <= exported, sorted(ALL - CUDA_ONLY - SPECULATIVE_ONLY - exported)
    assert {n for n in exported if n.startswith("specdeploy_")} <= ALL
    for name in COUNTERS - SPECULATIVE_ONLY:
        assert re.search(rf"^{name}_total(\{{.*\}})? ", text, re.M), name
    for name in HISTOGRAMS:
        assert f"{name}_bucket{{" in text, name
    assert re.search(r'^specdeploy_requests_total\{endpoint="/v1/completions",status="200"\} [1-9]', text, re.M)
    assert "_created" not in text


def test_token_counters_follow_the_engine(server: Any) -> None:
    before = server.metric("specdeploy_generation_tokens_total")
    with server.client() as client:
        client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 7, "ignore_eos": True})
    assert server.metric("specdeploy_generation_tokens_total") - before == 7
    assert server.metric("specdeploy_ready") == 1
    assert server.metric("specdeploy_process_resident_memory_bytes") > 50e6


def test_metrics_can_require_a_key(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from serving.api.settings import ApiKeyEntry, Settings
    from serving.config import ServerConfig
    from serving.main import create_app

    config = ServerConfig.model_validate({"service": {"metrics_require_auth": True},
                                          "model": {"path": str(tmp_path / "absent")}})
    settings = Settings(config=config, api_keys=(ApiKeyEntry("prom", "scrape-key-0123456789"),))
    with TestClient(create_app(settings)) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"Authorization": "Bearer scrape-key-0123456789"}).status_code == 200
        assert client.get("/ready").status_code == 503  # probes stay open


def test_prefix_cache_counters_follow_the_engine_totals() -> None:
    from serving.api.metrics import ServerMetrics
    from serving.engine.types import EngineStats

    def stats(queries: int, hits: int) -> EngineStats:
        return EngineStats(num_waiting=0, num_running=0, kv_blocks_used=0, kv_blocks_total=8, kv_block_size=16,
                           prompt_tokens_total=0, generation_tokens_total=0, preemptions_total=0,
                           requests_finished_total=0, steps_total=0, step_time_total_s=0.0, last_step_s=0.0,
                           recent_step_durations_s=[], prefix_cache_queries_total=queries,
                           prefix_cache_hits_total=hits)

    metrics = ServerMetrics(speculative=False)
    metrics.refresh(stats(100, 64), ready=True)
    metrics.refresh(stats(250, 192), ready=True)
    text = metrics.render().decode()
    assert re.search(rf"^{metric_names.PREFIX_CACHE_QUERIES}_total 250\.0$", text, re.M)
    assert re.search(rf"^{metric_names.PREFIX_CACHE_HITS}_total 192\.0$", text, re.M)


def test_speculation_counters_follow_the_speculator_totals() -> None:
    """Drafts, draft and accepted tokens, and the guard's steps, vetoed steps, plain-measuring steps and vetoes
    become counters; the share of steps vetoed (rate of vetoed ÷ rate of steps) is what the dashboard plots."""
    from serving.api.metrics import ServerMetrics
    from serving.engine.types import EngineStats, SpecStats

    def stats(cycles: int, vetoed: int, plain: int, vetoes: int) -> EngineStats:
        return EngineStats(num_waiting=0, num_running=0, kv_blocks_used=0, kv_blocks_total=8, kv_block_size=16,
                           prompt_tokens_total=0, generation_tokens_total=0, preemptions_total=0,
                           requests_finished_total=0, steps_total=0, step_time_total_s=0.0, last_step_s=0.0,
                           recent_step_durations_s=[],
                           spec=SpecStats(num_drafts=cycles - vetoed, num_draft_tokens=4 * cycles,
                                          num_accepted_tokens=3 * cycles, guard_cycles=cycles,
                                          guard_vetoed_cycles=vetoed, guard_plain_cycles=plain, guard_vetoes=vetoes))

    metrics = ServerMetrics(speculative=True)
    metrics.refresh(stats(100, 10, 20, 1), ready=True)
    metrics.refresh(stats(400, 250, 30, 2), ready=True)
    text = metrics.render().decode()
    for name, value in ((metric_names.SPEC_DRAFTS, 150), (metric_names.SPEC_DRAFT_TOKENS, 1600),
                        (metric_names.SPEC_ACCEPTED_TOKENS, 1200),
                        (metric_names.SPEC_GUARD_CYCLES, 400), (metric_names.SPEC_GUARD_VETOED_CYCLES, 250),
                        (metric_names.SPEC_GUARD_PLAIN_CYCLES, 30), (metric_names.SPEC_GUARD_VETOES, 2)):
        assert re.search(rf"^{name}_total {value}\.0$", text, re.M), name
