"""`specdeploy bench http` (infra/bench/http.py): the servers it starts run the plain config, and its
figures come from both servers' real responses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    assert summary == {"worst_loaded_ratio": 0.95, "loaded_at_goal": "1/2", "c1_speedup": 2.5, "c1_p99_ratio": 0.45,
                       "identical": "8/8", "threads_ratio": 1.0}
    assert json.loads(http.dumps(report))["summary"] == summary


def test_the_matrix_measures_a_control_first_and_the_summary_keeps_it_apart(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    """Each dtype's first row is a second spec-off server measured as the rows are; its ratios are reported as
    the control's and never count as a row's (here it reads 0.94, the one row 0.99)."""
    import contextlib
    from types import SimpleNamespace

    started: list[Variant] = []

    @contextlib.contextmanager
    def fake_serving(workdir: Path, target: Path, draft: Path, variant: Variant, output_len: int) -> Any:
        started.append(variant)
        yield SimpleNamespace(endpoint=variant.name), f"decisions of {variant.name}"

    async def fake_measure(off: str, on: str, prompts: object, c: int, output_len: int, repeats: int) -> Pair:
        return Pair(c, 100.0, 94.0 if on.startswith("control") else 99.0)

    monkeypatch.setattr(http, "serving", fake_serving)
    monkeypatch.setattr(http, "measure_loaded", fake_measure)
    monkeypatch.setattr(http, "published", lambda model_dir, workdir, name: model_dir)
    report = http.run_matrix(Path("/t"), Path("/d"), [16, 64], 96, 8, 2, ["fp32"], [4], tmp_path,
                             say=lambda _: None, only=["ngram"])
    assert [v.name for v in started] == ["off fp32", "control: spec off dtype=fp32", "ngram k=4 dtype=fp32"]
    control, row = report.results
    assert control.control and not row.control
    assert control.variant.speculative == {} and control.variant.model == {"dtype": "fp32"}
    summary = http.summary(report)
    assert summary["worst_loaded_ratio"] == 0.99 and summary["loaded_at_goal"] == "2/2"
    assert summary["control_ratios"] == {"control: spec off dtype=fp32 c=16": 0.94,
                                         "control: spec off dtype=fp32 c=64": 0.94}
    assert json.loads(http.dumps(report))["results"][0]["control"] is True


@pytest.mark.slow
def test_the_plain_run_measures_both_servers_through_http(tmp_path: Path) -> None:
    """The demo pair, two prompts, short outputs: both servers start from the plain config, answer, and the
    report carries their start-up decisions and identical greedy texts (fp32 on CPU)."""
    from serving.demo import draft_path, target_path

    lines: list[str] = []
    report = http.run_plain(target_path(), draft_path(), [1, 2], 12, 2, 2, False, tmp_path, lines.append)
    (result,) = report.results
    assert [p.concurrency for p in result.pairs] == [1, 2]
    c1 = result.pairs[0]
    assert c1.compared == 2 and c1.identical == 2
    assert all(p.off_tokens_per_s > 0 and p.on_tokens_per_s > 0 for p in result.pairs)
    loaded = result.pairs[1]  # c=2: steady figures from the servers' generation counters, whole phases beside
    assert loaded.off_phase_tokens_per_s and loaded.on_phase_tokens_per_s and loaded.phase_ratio
    assert len(loaded.off_rounds) == len(loaded.on_rounds) == 2 and loaded.interval is not None
    assert "speculative.draft_token_map token_map.json (auto: token_map.json, listed in the draft's manifest.json)" \
        in result.decisions
    assert "model.dtype float32 (auto" in report.off_decisions["default"]


def test_a_loaded_pair_warms_each_server_first_and_pools_its_measured_phases(monkeypatch: pytest.MonkeyPatch) -> None:
    """One unmeasured phase per server at the pair's concurrency, then rounds of an off and an on phase of 2c (at
    least MIN_PHASE_REQUESTS), the order swapped every round. Each side pools its measured phases' steady windows
    (tokens over seconds), so neither a fast warm-up nor one lucky phase decides; each phase's figure is kept."""
    import asyncio

    calls: list[tuple[str, int]] = []
    # (steady tokens, steady seconds) of each measured phase in turn; the warm-ups read 10x faster
    measured = {"off": [(100.0, 1.0), (300.0, 2.0)], "on": [(240.0, 1.0), (120.0, 1.0)]}

    async def phase(client: object, base: str, prompts: object, concurrency: int, requests: int,
                    output_len: int) -> Phase:
        assert concurrency == 4
        calls.append((base, requests))
        if requests == 4:
            return Phase(1000.0, 1.0, 1000, 1.0, [9.0])
        tokens, seconds = measured[base].pop(0)
        return Phase(tokens, seconds, int(tokens), 2 * seconds, [0.1 * len(calls)])

    monkeypatch.setattr(http, "_closed_loop", phase)
    pair = asyncio.run(http.measure_loaded("off", "on", ["p"], 4, 16, 2))
    assert calls == [("off", 4), ("on", 4), ("off", 32), ("on", 32), ("on", 32), ("off", 32)]
    # off: 400 tokens in 3 s; on: 360 in 2 s (the best phases alone would read 240 ÷ 150 = 1.6)
    assert pair.off_tokens_per_s == pytest.approx(400 / 3) and pair.on_tokens_per_s == pytest.approx(180.0)
    assert pair.ratio == pytest.approx(1.35)
    assert (pair.off_phase_tokens_per_s, pair.on_phase_tokens_per_s) == (pytest.approx(400 / 6), 90.0)
    assert pair.off_rounds == [100.0, 150.0] and pair.on_rounds == [240.0, 120.0]
    assert (pair.off_p99_s, pair.on_p99_s) == (pytest.approx(0.6), pytest.approx(0.5))  # warm-ups left out
    low, high = pair.interval
    assert low < 0.8 < 2.4 < high  # the rounds read 2.4 and 0.8: two rounds that disagree say little


def test_the_interval_comes_from_the_rounds_paired_ratios() -> None:
    """Rounds whose host speed moves (both sides alike) but whose ratio does not give a tight interval; the
    same phases unpaired would not. One round gives none."""
    off = [1000.0, 1200.0, 900.0, 1100.0, 1000.0]
    low, high = http.ratio_interval(off, [1.02 * v for v in off])
    assert low == pytest.approx(1.02) and high == pytest.approx(1.02)
    low, high = http.ratio_interval(off, [v * r for v, r in zip(off, (1.0, 1.04, 0.98, 1.03, 0.99), strict=True)])
    assert 0.98 < low < 1.008 < high < 1.04
    assert http.ratio_interval([1000.0], [990.0]) is None
    assert Pair(16, 1.0, 1.0).interval is None


def test_a_loaded_phase_is_2c_requests_and_never_under_the_minimum(monkeypatch: pytest.MonkeyPatch) -> None:
    """At c=4 a measured phase of 2c = 8 requests is mostly its start and its drain: it carries 32; at c=64, 128."""
    import asyncio

    sizes: dict[int, set[int]] = {}

    async def phase(client: object, base: str, prompts: object, concurrency: int, requests: int,
                    output_len: int) -> Phase:
        if requests != concurrency:  # not the warm-up
            sizes.setdefault(concurrency, set()).add(requests)
        return Phase(1.0, 1.0, 1, 1.0, [0.1])

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
