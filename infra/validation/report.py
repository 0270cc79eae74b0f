"""The launch report: one self-contained HTML file (plots embedded as PNG), JSON and a markdown summary.

Render check (headless Chromium; ``apt-get install -y chromium`` where it is missing)::

    chromium --headless --no-sandbox --disable-gpu --window-size=1280,4000 \
        --screenshot=report.png file://$PWD/<report dir>/report.html
"""

from __future__ import annotations

import base64
import html
import io
import json
import time
from pathlib import Path
from typing import Any

from infra.validation.abtest import ABResult
from infra.validation.loadgen import Phase
from infra.validation.record import (
    GROUPS,
    MEMORY_NOISE_FLOOR_MIB,
    REPORT_HTML,
    REPORT_JSON,
    REPORT_MD,
    LaunchRun,
    memory_leak_suspected,
    slo_figures,
)

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1200px;color:#222}
h1{margin-bottom:.2rem} .verdict{font-size:1.4rem;font-weight:700;padding:.4rem .8rem;border-radius:6px;
display:inline-block} .pass{background:#d8f5dd;color:#125b24} .fail{background:#fadbd8;color:#8a1c12}
.skip{color:#777} table{border-collapse:collapse;margin:.6rem 0 1.4rem;font-size:.92rem}
th,td{border:1px solid #ccc;padding:.3rem .55rem;text-align:left;vertical-align:top}
th{background:#f2f2f2} td.num{text-align:right;font-variant-numeric:tabular-nums}
img{max-width:100%;border:1px solid #ddd;margin:.4rem 0 1rem} code{background:#f4f4f4;padding:0 .2rem}
"""


def _fmt(value: Any, scale: float = 1.0, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float | int):
        return f"{value * scale:.{digits}f}"
    return html.escape(str(value))


def _png(fig: Any) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _figure(rows: int = 1, cols: int = 2, height: float = 3.6) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=(11, height * rows), squeeze=False)
    return fig, axes


def _close(fig: Any) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)


def plot_sweep(sweep: list[Phase]) -> str | None:
    """Latency and throughput vs concurrency."""
    if not sweep:
        return None
    summaries = sorted((p.summary() for p in sweep), key=lambda s: s["concurrency"])
    levels = [s["concurrency"] for s in summaries]
    fig, axes = _figure(1, 2)
    lat, tput = axes[0]
    for key, label, marker in (("e2e_s", "E2E", "o"), ("ttft_s", "TTFT", "s")):
        lat.plot(levels, [s[key]["p50"] for s in summaries], f"-{marker}", label=f"{label} P50")
        lat.plot(levels, [s[key]["p99"] for s in summaries], f"--{marker}", label=f"{label} P99")
    lat.set(xlabel="concurrency (requests in flight)", ylabel="seconds", title="Latency vs concurrency")
    lat.set_xscale("log", base=2)
    lat.legend(fontsize=8)
    lat.grid(alpha=0.3)
    tput.plot(levels, [s["token_throughput_tps"] for s in summaries], "-o", color="tab:green", label="tokens/s")
    tput.set(xlabel="concurrency (requests in flight)", ylabel="output tokens / s", title="Throughput vs concurrency")
    tput.set_xscale("log", base=2)
    tput.grid(alpha=0.3)
    for level, summary in zip(levels, summaries, strict=True):  # requests/s as labels: a twin axis hides a line
        tput.annotate(f"{summary['request_throughput_rps']:.2f} req/s", (level, summary["token_throughput_tps"]),
                      textcoords="offset points", xytext=(4, -12), fontsize=8)
    tput.legend(loc="upper left", fontsize=8)
    encoded = _png(fig)
    _close(fig)
    return encoded


def plot_ab(ab: ABResult) -> str | None:
    """Speculation on vs off per prompt set: P99 E2E and token throughput, error bars = repeat range."""
    if not ab.cells:
        return None
    levels = sorted({c for _, c in ab.cells})
    sets = sorted({ps for ps, _ in ab.cells})
    fig, axes = _figure(2, len(levels), height=3.2)
    width = 0.38
    for col, level in enumerate(levels):
        for row, (metric, ylabel) in enumerate((("p99", "P99 E2E (s)"), ("tput", "output tokens / s"))):
            ax = axes[row][col]
            for offset, (arm_index, label, color) in ((-width / 2, (0, "spec on", "tab:blue")),
                                                      (width / 2, (1, "spec off", "tab:gray"))):
                values, low, high = [], [], []
                for ps in sets:
                    arm = ab.cells[(ps, level)][arm_index]
                    repeats = arm.repeat_p99s() if metric == "p99" else arm.repeat_throughputs()
                    value = (arm.p99_e2e() if metric == "p99" else arm.throughput()) or 0.0
                    values.append(value)
                    low.append(max(0.0, value - min(repeats, default=value)))
                    high.append(max(0.0, max(repeats, default=value) - value))
                xs = [i + offset for i in range(len(sets))]
                ax.bar(xs, values, width, yerr=[low, high], capsize=3, label=label, color=color)
            ax.set_xticks(range(len(sets)), sets)
            ax.set_ylabel(ylabel)
            ax.set_title(f"concurrency {level}")
            ax.grid(axis="y", alpha=0.3)
            if row == 0 and col == 0:
                ax.legend(fontsize=8)
    encoded = _png(fig)
    _close(fig)
    return encoded


def plot_memory(run: LaunchRun) -> str | None:
    """Memory (and queue length) over time during the sustained run, with the fitted trend."""
    phase = run.sustained
    if phase is None or not phase.samples:
        return None
    fig, axes = _figure(1, 2)
    mem, queue = axes[0]
    ts = [p.t_s / 60 for p in phase.samples if p.rss_bytes is not None]
    rss = [float(p.rss_bytes) / 2**20 for p in phase.samples if p.rss_bytes is not None]
    mem.plot(ts, rss, "-", label="server RSS (MiB)")
    gpu = [(p.t_s / 60, float(p.gpu_memory_bytes) / 2**20) for p in phase.samples if p.gpu_memory_bytes is not None]
    if gpu:
        mem.plot([t for t, _ in gpu], [g for _, g in gpu], "-", label="GPU memory (MiB)")
    trend = run.memory_trend()
    if trend is not None:
        x0, x1 = trend["from_s"] / 60, trend["to_s"] / 60
        fit = [trend["intercept_mib"] + trend["slope_mib_per_min"] * x for x in (x0, x1)]
        mem.plot([x0, x1], fit, "--", color="tab:red",
                 label=f"trend {trend['slope_mib_per_min']:+.2f} MiB/min")
    mem.set(xlabel="minutes", ylabel="MiB", title="Memory over time (sustained load)")
    mem.legend(fontsize=8)
    mem.grid(alpha=0.3)
    qt = [p.t_s / 60 for p in phase.samples if p.waiting is not None]
    queue.plot(qt, [p.waiting for p in phase.samples if p.waiting is not None], "-", label="waiting")
    queue.plot(qt, [p.running for p in phase.samples if p.waiting is not None], "-", label="running")
    queue.set(xlabel="minutes", ylabel="requests", title="Queue over time (from /metrics)")
    queue.legend(fontsize=8)
    queue.grid(alpha=0.3)
    encoded = _png(fig)
    _close(fig)
    return encoded


def _table(headers: list[str], rows: list[list[str]], numeric: set[int] | None = None) -> str:
    numeric = numeric or set()
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td class='num'>{c}</td>" if i in numeric else f"<td>{c}</td>" for i, c in enumerate(row))
        + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _slo_rows(run: LaunchRun) -> tuple[str, list[list[str]]]:
    phase = run.sustained or next((p for p in run.sweep if p.concurrency == run.target_concurrency), None)
    if phase is None:
        return "", []
    rows = []
    for f in slo_figures(phase.summary(run.targets), run.slo):
        sign = "≥" if f.higher_is_better else "≤"
        rows.append([html.escape(f.name), f"{sign} {f.target:g} {f.unit}", f"{_fmt(f.measured)} {f.unit}",
                     "<b class='pass'>pass</b>" if f.passed else "<b class='fail'>FAIL</b>"])
    trend = run.memory_trend()
    if trend is not None:
        ok = not memory_leak_suspected(trend, run.slo["memory_slope_mb_per_min"])
        rows.append(["memory trend", f"≤ {run.slo['memory_slope_mb_per_min']:g} MiB/min "
                     f"(or ≤ {MEMORY_NOISE_FLOOR_MIB:g} MiB in all)",
                     f"{trend['slope_mib_per_min']:+.2f} MiB/min ({trend['growth_mib']:+.1f} MiB in all)",
                     "<b class='pass'>pass</b>" if ok else "<b class='fail'>FAIL</b>"])
    return phase.name, rows


def _sweep_rows(phases: list[Phase], run: LaunchRun) -> list[list[str]]:
    rows = []
    for p in phases:
        s = p.summary(run.targets)
        rows.append([html.escape(p.name), str(s["requests"]), _fmt(s["ttft_s"]["p50"], 1000, 0),
                     _fmt(s["ttft_s"]["p99"], 1000, 0), _fmt(s["tpot_s"]["p50"], 1000, 1),
                     _fmt(s["tpot_s"]["p99"], 1000, 1), _fmt(s["e2e_s"]["p50"]), _fmt(s["e2e_s"]["p99"]),
                     _fmt(s["token_throughput_tps"], 1, 1), _fmt(s["request_throughput_rps"]),
                     _fmt(s.get("goodput_share"), 100, 0) + " %", _fmt(s["peak_rss_bytes"], 2**-20, 0),
                     _fmt(s["peak_gpu_memory_bytes"], 2**-20, 0), _fmt(s["max_queue_length"], 1, 0),
                     html.escape(json.dumps(s["errors_by_status"]) if s["errors"] else "0")])
    return rows


_SWEEP_HEADERS = ["phase", "requests", "TTFT P50 ms", "TTFT P99 ms", "TPOT P50 ms", "TPOT P99 ms", "E2E P50 s",
                  "E2E P99 s", "tokens/s", "req/s", "goodput", "peak RSS MiB", "peak GPU MiB", "max queue", "errors"]


def _ab_section(run: LaunchRun) -> str:
    if run.ab is None:
        return "<p class='skip'>The speculative A/B did not run.</p>"
    data = run.ab.to_json()
    rows = []
    for cell in data["cells"]:
        on, off, d = cell["on"], cell["off"], cell["decision"]
        rate = on["acceptance_rate"]
        rows.append([html.escape(cell["prompt_set"]), str(cell["concurrency"]),
                     f"<b class='{'pass' if d['verdict'] == 'enable' else 'fail'}'>{d['verdict']}</b>",
                     f"{_fmt(off['p99_e2e_s'])} → {_fmt(on['p99_e2e_s'])}",
                     _spread(off["p99_e2e_spread_s"]) + " / " + _spread(on["p99_e2e_spread_s"]),
                     f"{_fmt(off['token_throughput_tps'], 1, 1)} → {_fmt(on['token_throughput_tps'], 1, 1)}",
                     f"{_fmt(off['p99_tpot_s'], 1000, 1)} → {_fmt(on['p99_tpot_s'], 1000, 1)}",
                     "–" if rate is None else f"{rate:.0%}",
                     "–" if (vetoed := on.get("guard_vetoed_share")) is None else f"{vetoed:.0%}",
                     html.escape(d["reason"])])
    rule = run.ab.rule
    parts = [
        f"<p>Rule (deployment guide, launch validation step 3): enable only if P99 E2E latency drops by at "
        f"least {rule.min_p99_gain:.0%}, the "
        f"repeats rank that way beyond noise (exact one-sided Mann-Whitney p ≤ {rule.max_p_value:g}), and "
        f"output-token throughput drops by at most {rule.max_throughput_loss:.0%}. "
        f"Method: {html.escape(run.ab.method)}</p>",
        _table(["prompt set", "concurrency", "decision", "P99 E2E s off → on", "spread off / on (min–max s)",
                "tokens/s off → on", "P99 TPOT ms off → on", "acceptance", "guard vetoed", "why"], rows),
    ]
    if run.recommendation:
        rec = run.recommendation
        parts.append(f"<p><b>Recommended:</b> speculation {'on' if rec['enabled'] else 'off'} — "
                     f"{html.escape(rec['reason'])}.</p>")
        if rec.get("config"):
            lines = "".join(f"\n  {key}: {json.dumps(value)}" for key, value in rec["config"].items())
            parts.append(f"<pre><code>specdeploy:speculative:{html.escape(lines)}</code></pre>")
    return "".join(parts)


def _spread(value: Any) -> str:
    if not value:
        return "–"
    return f"{value[1]:.2f}–{value[2]:.2f}"


def served_by(stack: str) -> str:
    """How the stack's server runs: the image under podman, this checkout's process, or the platform."""
    from infra.config import ConfigError, load_stack

    try:
        config = load_stack(stack).config
    except (ConfigError, OSError, ValueError):
        return ""  # a stack file not at hand (a report rendered elsewhere): say nothing rather than guess
    if config.platform != "local":
        return f"platform {config.platform}"
    if config.local.runtime == "container":
        return f"container (image {config.local.image}, podman)"
    return "local process (this checkout)"


def server_line(run: LaunchRun) -> str:
    """What served the run and where its host checks ran, e.g. ``container (image ..., podman); host
    checks on podman://specdeploy-local-container``; empty when neither is known."""
    server = run.server
    if run.hosts:
        where = ", ".join(run.hosts)
        server = f"{server}; host checks on {where}" if server else f"host checks on {where}"
    return server


def render_html(run: LaunchRun) -> str:
    verdict = "PASS" if run.passed else "FAIL"
    counts = run.counts()
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(run.started_at))
    server = server_line(run)
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>specdeploy launch report: {html.escape(run.stack)} ({verdict})</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>Launch validation: stack <code>{html.escape(run.stack)}</code></h1>",
        f"<p>Endpoint <code>{html.escape(run.endpoint)}</code>, profile <b>{html.escape(run.profile)}</b>, "
        f"started {when}, {((run.finished_at or time.time()) - run.started_at) / 60:.1f} min."
        + (f" Server: <b>{html.escape(server)}</b>." if server else "") + "</p>",
        f"<p class='verdict {'pass' if run.passed else 'fail'}'>{verdict}</p> "
        f"<span>{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped</span>",
    ]
    figure_title, slo_rows = _slo_rows(run)
    parts.append(f"<h2>SLOs at target concurrency {run.target_concurrency}</h2>")
    if slo_rows:
        parts.append(f"<p>Measured in: {html.escape(figure_title)}</p>")
        parts.append(_table(["figure", "target", "measured", "result"], slo_rows))
    else:
        parts.append("<p class='skip'>Not measured in this run.</p>")
    parts.append("<h2>Performance baseline</h2>")
    sweep_plot = plot_sweep(run.sweep)
    if sweep_plot:
        parts.append(f"<img alt='latency and throughput vs concurrency' src='data:image/png;base64,{sweep_plot}'>")
    phases = run.sweep + [p for p in (run.open_loop, run.sustained) if p is not None]
    if phases:
        parts.append(_table(_SWEEP_HEADERS, _sweep_rows(phases, run), numeric=set(range(1, 14))))
    else:
        parts.append("<p class='skip'>No load phase ran.</p>")
    parts.append("<h2>Speculative decoding A/B</h2>")
    ab_plot = plot_ab(run.ab) if run.ab else None
    if ab_plot:
        parts.append(f"<img alt='speculation on vs off per prompt set' src='data:image/png;base64,{ab_plot}'>")
    parts.append(_ab_section(run))
    parts.append("<h2>Stability</h2>")
    memory_plot = plot_memory(run)
    if memory_plot:
        parts.append(f"<img alt='memory over time' src='data:image/png;base64,{memory_plot}'>")
    else:
        parts.append("<p class='skip'>No sustained run in this session.</p>")
    parts.append("<h2>Checks</h2>")
    for group in GROUPS:
        rows = [[html.escape(c.nodeid.split("::", 1)[-1]),
                 f"<span class='{ {'passed': 'pass', 'failed': 'fail'}.get(c.outcome, 'skip')}'>{c.outcome}</span>",
                 f"{c.duration_s:.1f}", html.escape(c.message[:400])]
                for c in run.checks if c.group == group]
        if rows:
            parts.append(f"<h3>{group}</h3>" + _table(["check", "result", "s", "detail"], rows, numeric={2}))
    if run.notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in run.notes) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def render_markdown(run: LaunchRun, report_dir: Path | None = None) -> str:
    counts = run.counts()
    lines = [
        f"# Launch validation: {run.stack} ({run.profile}): {'PASS' if run.passed else 'FAIL'}",
        "",
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped; endpoint {run.endpoint}.",
    ]
    server = server_line(run)
    if server:
        lines += ["", f"Server: {server}."]
    failed = [c for c in run.checks if c.outcome == "failed"]
    if failed:
        lines += ["", "## Failed checks", ""]
        lines += [f"- `{c.nodeid}`: {c.message.splitlines()[0][:200] if c.message else ''}" for c in failed]
    _, slo_rows = _slo_rows(run)
    if slo_rows:
        lines += ["", f"## SLOs at concurrency {run.target_concurrency}", "", "| figure | target | measured | result |",
                  "|---|---|---|---|"]
        lines += [f"| {r[0]} | {r[1]} | {r[2]} | {'pass' if 'pass' in r[3] else 'FAIL'} |" for r in slo_rows]
    if run.ab is not None:
        lines += ["", "## Speculative decoding", "", "| prompt set | concurrency | decision | why |",
                  "|---|---|---|---|"]
        lines += [f"| {d.prompt_set} | {d.concurrency} | {d.verdict} | {d.reason} |" for d in run.ab.decisions()]
        if run.recommendation:
            rec = run.recommendation
            lines += ["", f"Recommended: `speculative.enabled: {str(rec['enabled']).lower()}` ({rec['reason']})."]
            if rec.get("config"):
                lines += ["", "```yaml", "specdeploy:speculative:"]
                lines += [f"  {key}: {json.dumps(value)}" for key, value in rec["config"].items()] + ["```"]
    if report_dir is not None:
        lines += ["", f"Full report: {report_dir / REPORT_HTML}"]
    return "\n".join(lines) + "\n"


def write_report(run: LaunchRun, report_dir: Path) -> dict[str, Path]:
    """Write report.json, summary.md and report.html into ``report_dir``; returns their paths."""
    report_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": report_dir / REPORT_JSON, "markdown": report_dir / REPORT_MD, "html": report_dir / REPORT_HTML}
    paths["json"].write_text(json.dumps(run.to_json(), indent=1, default=str) + "\n", encoding="utf-8")
    paths["markdown"].write_text(render_markdown(run, report_dir), encoding="utf-8")
    paths["html"].write_text(render_html(run), encoding="utf-8")
    return paths
