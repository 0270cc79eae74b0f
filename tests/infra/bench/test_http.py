"""`specdeploy bench http` (infra/bench/http.py): the servers it starts run the plain config, and its
figures come from both servers' real responses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.bench import http
from infra.bench.http import HttpBenchReport, Pair, Phase, Variant, VariantResult
from serving.config import ServerConfig


def test_a_servers_config_names_the_model_paths_and_nothing_that_bears_on_speed() -> None:
    plain = http.server_config(Path("/t"), Path("/d"), http.plain_variant(), 8123, 96)
    assert plain["model"] == {"path": "/t"}
    assert plain["speculative"] == {"enabled": True, "method": "draft", "draft_model": "/d"}
    assert set(plain["scheduler"]) == {"request_timeout_s", "max_output_len"}  # limits, not speed settings
    config = ServerConfig.model_validate(plain)  # the server takes it as it is, every other key at its default
    assert config.model.dtype == "auto" and config.model.num_threads == "auto"
    assert config.speculative.num_draft_tokens == 12 and config.speculative.draft_token_map == "auto"
    off = http.server_config(Path("/t"), Path("/d"), Variant("off"), 8124, 96)
    assert "speculative" not in off and not ServerConfig.model_validate(off).speculative.enabled


def test_the_matrix_covers_k_token_map_and_proposer() -> None:
    variants = http.matrix_variants((4, 8, 12))
    assert len(variants) == 9
    draft = {(v.speculative["num_draft_tokens"], v.speculative["draft_token_map"]) for v in variants
             if v.speculative["method"] == "draft"}
    assert draft == {(k, m) for k in (4, 8, 12) for m in ("auto", "none")}
    assert {v.speculative["num_draft_tokens"] for v in variants if v.speculative["method"] == "ngram"} == {4, 8, 12}
    for v in variants:
        ServerConfig.model_validate(http.server_config(Path("/t"), Path("/d"), v, 1, 96))


def test_the_server_environment_drops_thread_variables_and_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("SPECDEPLOY__MODEL__DTYPE", "bf16")
    env = http.clean_environment()
    assert "OMP_NUM_THREADS" not in env and "SPECDEPLOY__MODEL__DTYPE" not in env


def test_held_out_prompts_are_spread_over_the_set_and_a_bad_count_is_named() -> None:
    prompts = http.held_out_prompts(8)
    assert len(set(prompts)) == 8
    with pytest.raises(ValueError, match="--prompts 400"):
        http.held_out_prompts(400)


def test_the_summary_reports_the_worst_loaded_ratio_and_the_c1_figures() -> None:
    report = HttpBenchReport("/t", "/d", 96, 8, {})
    report.results.append(VariantResult(Variant("a"), "x", [Pair(1, 100.0, 250.0, 1.0, 0.45, 8, 8),
                                                            Pair(16, 1000.0, 990.0)]))
    report.results.append(VariantResult(Variant("b"), "y", [Pair(64, 2000.0, 1900.0)]))
    report.threads_c1_ratio = {1: 1.0, 2: 1.4}
    summary = http.summary(report)
    assert summary == {"worst_loaded_ratio": 0.95, "c1_speedup": 2.5, "c1_p99_ratio": 0.45, "identical": "8/8",
                       "threads_ratio": 1.0}
    assert json.loads(http.dumps(report))["summary"] == summary


@pytest.mark.slow
def test_the_plain_run_measures_both_servers_through_http(tmp_path: Path) -> None:
    """The demo pair, two prompts, short outputs: both servers start from the plain config, answer, and the
    report carries their start-up decisions and identical greedy texts (fp32 on CPU)."""
    from serving.demo import draft_path, target_path

    lines: list[str] = []
    report = http.run_plain(target_path(), draft_path(), [1, 2], 12, 2, 1, False, tmp_path, lines.append)
    (result,) = report.results
    assert [p.concurrency for p in result.pairs] == [1, 2]
    c1 = result.pairs[0]
    assert c1.compared == 2 and c1.identical == 2
    assert all(p.off_tokens_per_s > 0 and p.on_tokens_per_s > 0 for p in result.pairs)
    loaded = result.pairs[1]  # c=2: steady figures from the servers' generation counters, whole phases beside
    assert loaded.off_phase_tokens_per_s and loaded.on_phase_tokens_per_s and loaded.phase_ratio
    assert "speculative.draft_token_map token_map.json (auto: token_map.json, listed in the draft's manifest.json)" \
        in result.decisions
    assert "model.dtype float32 (auto" in report.off_decisions["default"]


def test_a_loaded_pair_warms_each_server_first_and_leaves_the_warm_up_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """One unmeasured phase per server at the pair's concurrency, then alternating measured phases of 2c (at
    least MIN_PHASE_REQUESTS): a fast (or slow) warm-up phase never becomes a side's best."""
    import asyncio

    calls: list[tuple[str, int]] = []
    rates = {("off", 4): 9_999.0, ("on", 4): 9_999.0, ("off", 32): 100.0, ("on", 32): 120.0}

    async def phase(client: object, base: str, prompts: object, concurrency: int, requests: int,
                    output_len: int) -> Phase:
        assert concurrency == 4
        calls.append((base, requests))
        steady = rates[(base, requests)] + len(calls)
        return Phase(steady, steady / 2, [0.1 * len(calls)])

    monkeypatch.setattr(http, "_closed_loop", phase)
    pair = asyncio.run(http.measure_loaded("off", "on", ["p"], 4, 16, 2))
    assert calls == [("off", 4), ("on", 4), ("off", 32), ("on", 32), ("on", 32), ("off", 32)]
    assert (pair.off_tokens_per_s, pair.on_tokens_per_s) == (106.0, 125.0)  # the best measured phase of each
    assert (pair.off_phase_tokens_per_s, pair.on_phase_tokens_per_s) == (53.0, 62.5)  # the same phases, whole
    assert (pair.off_p99_s, pair.on_p99_s) == (pytest.approx(0.6), pytest.approx(0.5))


def test_a_loaded_phase_is_2c_requests_and_never_under_the_minimum(monkeypatch: pytest.MonkeyPatch) -> None:
    """At c=4 a measured phase of 2c = 8 requests is mostly its start and its drain: it carries 32; at c=64, 128."""
    import asyncio

    sizes: dict[int, set[int]] = {}

    async def phase(client: object, base: str, prompts: object, concurrency: int, requests: int,
                    output_len: int) -> Phase:
        if requests != concurrency:  # not the warm-up
            sizes.setdefault(concurrency, set()).add(requests)
        return Phase(1.0, 1.0, [0.1])

    monkeypatch.setattr(http, "_closed_loop", phase)
    for c in (4, 16, 64):
        asyncio.run(http.measure_loaded("off", "on", ["p"], c, 16, 2))
    assert sizes == {4: {http.MIN_PHASE_REQUESTS}, 16: {32}, 64: {128}}


def test_a_phase_s_steady_figure_ends_when_its_last_request_goes_out_and_leaves_the_drain_out() -> None:
    """A fake server generating 10 tokens/request, 20 ms a request but the last one, which takes 300 ms (a
    spread drain): the steady window reads the server's counter from the phase's start until the last request
    is sent; the whole figure carries the drain."""
    import asyncio

    import httpx

    state = {"generated": 0, "served": 0}

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            series = f"specdeploy_generation_tokens_total {state['generated']}.0"
            return httpx.Response(200, text=f"# TYPE x counter\n{series}\n")
        state["served"] += 1
        await asyncio.sleep(0.3 if state["served"] == 8 else 0.02)
        state["generated"] += 10
        return httpx.Response(200, json={"usage": {"completion_tokens": 10}, "choices": [{"text": "x"}]})

    async def run() -> Phase:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await http._closed_loop(client, "http://fake", ["p"], 2, 8, 10)

    phase = asyncio.run(run())
    assert len(phase.latencies) == 8
    # 6 requests done in ~3 rounds of 20 ms before the last goes out: ~1,000 tokens/s; 80 tokens over ~0.36 s whole
    assert phase.steady_tokens_per_s > 2.5 * phase.tokens_per_s
    assert 40 <= phase.tokens_per_s * 0.3 <= 80


def test_a_server_without_the_generation_counter_is_named() -> None:
    import asyncio

    import httpx

    async def run() -> None:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text="other_total 1\n"))
        async with httpx.AsyncClient(transport=transport) as client:
            await http.generated_tokens(client, "http://fake")

    with pytest.raises(RuntimeError, match="http://fake/metrics has no specdeploy_generation_tokens_total"):
        asyncio.run(run())
