from __future__ import annotations

import base64
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from infra.validation.abtest import ABResult, ArmResult, DecisionRule
from infra.validation.loadgen import MetricsPoint, Phase, RequestRecord, SloTargets
from infra.validation.record import CheckOutcome, LaunchRun, slo_figures
from infra.validation.report import render_markdown, write_report

SLO = {"ttft_p99_ms": 2000, "tpot_p99_ms": 200, "e2e_p99_s": 30, "min_tokens_per_s": 0, "max_error_rate": 0.0,
       "target_concurrency": 4, "memory_slope_mb_per_min": 5.0}


def _phase(name: str, concurrency: int, e2e: float, labels: dict[str, str] | None = None) -> Phase:
    records = [RequestRecord("code", i * 0.1, 200, ttft_s=0.2, e2e_s=e2e + i * 0.01, output_tokens=16,
                             itl_s=[0.05] * 15) for i in range(8)]
    samples = [MetricsPoint(t, 300 * 2**20 + t * 1000, None, 1.0, float(concurrency), 4.0) for t in range(0, 60, 5)]
    return Phase(name, "closed", concurrency, None, 0.0, 10.0, records, samples, labels or {})


def _run() -> LaunchRun:
    run = LaunchRun("local", "http://127.0.0.1:8000", "quick", SLO, SloTargets(2.0, 0.2, 30.0), target_concurrency=4)
    run.sweep = [_phase(f"sweep c={c}", c, 1.0 + c / 4) for c in (1, 2, 4)]
    run.sustained = _phase("sustained c=4", 4, 2.0)
    cells = {}
    for ps in ("code", "writing"):
        for c in (1, 8):
            on, off = ArmResult(), ArmResult()
            on.phases = [_phase("a", c, (1.0 if ps == "code" else 2.0) + r / 10) for r in range(4)]
            off.phases = [_phase("b", c, 2.0 + r / 20) for r in range(4)]
            cells[(ps, c)] = (on, off)
    run.ab = ABResult(DecisionRule(), cells, method="two servers")
    run.recommendation = {**run.ab.recommendation(4), "config": {"enabled": True, "method": "draft"}}
    run.checks = [CheckOutcome("tests/launch/test_functional.py::test_health_answers_ok", "functional", "passed", "",
                               0.1),
                  CheckOutcome("tests/launch/test_host.py::test_gpu[local]", "host", "skipped", "CPU host", 0.0)]
    return run


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One rendered report for the module (matplotlib takes seconds per plot on a busy machine)."""
    return write_report(_run(), tmp_path_factory.mktemp("report"))


@pytest.fixture(scope="module")
def html(written: dict[str, Path]) -> str:
    return written["html"].read_text()


def test_html_is_self_contained_with_every_plot_embedded(html: str) -> None:
    images = html.count("src='data:image/png;base64,")
    assert images == 3  # sweep, A/B, memory
    assert "http://" not in html.replace("http://127.0.0.1:8000", "")  # nothing fetched from elsewhere
    first = html.split("base64,", 1)[1].split("'", 1)[0]
    assert base64.b64decode(first).startswith(b"\x89PNG")


def test_html_states_the_gate_slos_and_each_ab_decision(html: str) -> None:
    assert "PASS" in html and "P99 TTFT" in html and "memory trend" in html
    assert html.count("<b class='pass'>enable</b>") == 2  # code at both levels
    assert html.count("<b class='fail'>disable</b>") == 2  # writing: 0-5 % gain


def test_markdown_summary_lists_decisions_and_recommendation() -> None:
    text = render_markdown(_run(), Path("/r"))
    assert "| code | 1 | enable |" in text and "| writing | 8 | disable |" in text
    assert "Recommended: `speculative.enabled:" in text and "/r/report.html" in text
    assert "specdeploy:speculative:\n  enabled: true\n  method: \"draft\"" in text


def test_write_report_writes_json_markdown_and_html(written: dict[str, Path]) -> None:
    paths = written
    data = json.loads(paths["json"].read_text())
    assert data["passed"] and data["counts"] == {"passed": 1, "failed": 0, "skipped": 1}
    assert data["speculative_ab"]["cells"][0]["decision"]["reason"]
    assert paths["markdown"].is_file() and paths["html"].stat().st_size > 10_000


def test_slo_figures_compare_each_target() -> None:
    figures = {f.name: f for f in slo_figures(_phase("p", 4, 40.0).summary(), SLO)}
    assert not figures["P99 E2E"].passed and figures["P99 TTFT"].passed and figures["token throughput"].passed


def test_a_failed_check_fails_the_gate() -> None:
    run = _run()
    run.checks.append(CheckOutcome("x::test_y", "stability", "failed", "leak", 1.0))
    assert not run.passed and "FAIL" in render_markdown(run)


def _chromium() -> str | None:
    return next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"),
                             shutil.which("google-chrome")) if p), None)


@pytest.mark.slow
def test_report_renders_in_headless_chromium(written: dict[str, Path], tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium here (apt-get install -y chromium); the command is in infra/validation/report.py")
    paths = written
    shot = tmp_path / "report.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,3000",
                    f"--screenshot={shot}", paths["html"].as_uri()], check=True, capture_output=True, timeout=120)
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 50_000
