"""The serving dashboard: latency (TTFT, TPOT, E2E), throughput, queue, KV cache, speculation, errors.

Built as a Grafana dashboard JSON model (schemaVersion 39) from ``serving.metric_names``
only, so a renamed series breaks a test rather than a panel. Every query is scoped to the
``$namespace`` variable; ``slot`` is the label the ServiceMonitor sets from the Service's
`specdeploy.dev/slot` label, so blue and green can be compared during a canary.
"""

from __future__ import annotations

from typing import Any

from serving import metric_names as m

UID = "specdeploy-serving"
_SEL = 'namespace="$namespace"'
_BY_SLOT = "slot"


def _rate(metric: str, window: str = "$__rate_interval", extra: str = "") -> str:
    return f"rate({metric}{{{_SEL}{extra}}}[{window}])"


def _quantile(histogram: str, q: float) -> str:
    return f"histogram_quantile({q}, sum by (le, {_BY_SLOT}) ({_rate(f'{histogram}_bucket')}))"


def _target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"expr": expr, "legendFormat": legend, "refId": ref, "datasource": {"uid": "${datasource}"}}


def _panel(panel_id: int, title: str, unit: str, targets: list[tuple[str, str]], x: int, y: int,
           description: str) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [_target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(targets)],
    }


def _panels() -> list[dict[str, Any]]:
    slot = "{{" + _BY_SLOT + "}}"
    requests = f"{m.REQUESTS}_total"
    all_requests = f"clamp_min(sum by ({_BY_SLOT}) ({_rate(requests)}), 1e-9)"
    server_errors = _rate(requests, extra=',status=~"5.."')
    throttled = _rate(requests, extra=',status="429"')
    specs: list[tuple[str, str, list[tuple[str, str]], str]] = [
        ("Time to first token", "s", [
            (_quantile(m.TTFT, 0.5), f"p50 {slot}"),
            (_quantile(m.TTFT, 0.99), f"p99 {slot}"),
        ], "Queue wait plus prefill; the SLO and the SpecdeployHighP99Ttft alert read p99."),
        ("Time per output token", "s", [
            (_quantile(m.TPOT, 0.5), f"p50 {slot}"),
            (_quantile(m.TPOT, 0.99), f"p99 {slot}"),
        ], "(E2E - TTFT) / (output tokens - 1), as in vLLM's benchmark."),
        ("Throughput", "short", [
            (f"sum by ({_BY_SLOT}) ({_rate(f'{m.GENERATION_TOKENS}_total')})", f"generated tokens/s {slot}"),
            (f"sum by ({_BY_SLOT}) ({_rate(f'{m.PROMPT_TOKENS}_total')})", f"prompt tokens/s {slot}"),
            (f"sum by ({_BY_SLOT}) ({_rate(requests)})", f"requests/s {slot}"),
        ], "Aggregate tokens and requests per second over all pods of a slot."),
        ("Queue", "short", [
            (f"sum by ({_BY_SLOT}) ({m.WAITING}{{{_SEL}}})", f"waiting {slot}"),
            (f"sum by ({_BY_SLOT}) ({m.RUNNING}{{{_SEL}}})", f"running {slot}"),
        ], "Waiting requests drive the autoscaler (target per pod in the stack file)."),
        ("KV cache usage", "percentunit", [
            (f"sum by (pod) ({m.KV_BLOCKS_USED}{{{_SEL}}}) / "
             f"clamp_min(sum by (pod) ({m.KV_BLOCKS_TOTAL}{{{_SEL}}}), 1)", "{{pod}}"),
        ], "Share of KV cache blocks in use per pod; near 1 means preemptions."),
        ("Speculative acceptance rate", "percentunit", [
            (f"sum by ({_BY_SLOT}) ({_rate(f'{m.SPEC_ACCEPTED_TOKENS}_total')}) / "
             f"clamp_min(sum by ({_BY_SLOT}) ({_rate(f'{m.SPEC_DRAFT_TOKENS}_total')}), 1e-9)", f"accepted {slot}"),
        ], "Accepted draft tokens / proposed draft tokens."),
        ("Speculation guard", "percentunit", [
            (f"sum by ({_BY_SLOT}) ({_rate(f'{m.SPEC_GUARD_VETOED_CYCLES}_total')}) / "
             f"clamp_min(sum by ({_BY_SLOT}) ({_rate(f'{m.SPEC_GUARD_CYCLES}_total')}), 1e-9)", f"vetoed {slot}"),
            (f"sum by ({_BY_SLOT}) ({_rate(f'{m.SPEC_GUARD_PLAIN_CYCLES}_total')}) / "
             f"clamp_min(sum by ({_BY_SLOT}) ({_rate(f'{m.SPEC_GUARD_CYCLES}_total')}), 1e-9)", f"measuring {slot}"),
        ], "Share of decoding steps run without drafts: vetoed (drafting measured slower at that load) or measuring "
           "plain decoding. Near 1 at high load means speculation pays only at lower load."),
        ("Errors", "percentunit", [
            (f"sum by ({_BY_SLOT}) ({server_errors}) / {all_requests}", f"5xx share {slot}"),
            (f"sum by ({_BY_SLOT}) ({throttled}) / {all_requests}", f"429 share {slot}"),
        ], "Server errors page at the stack's error_rate_critical; 429 means admission control refused work."),
        ("End-to-end latency", "s", [
            (_quantile(m.E2E, 0.99), f"p99 {slot}"),
            (_quantile(m.QUEUE_TIME, 0.99), f"p99 queue time {slot}"),
        ], "Whole request, and the part of it spent waiting for a batch slot."),
        ("Ready pods", "short", [
            (f"sum by ({_BY_SLOT}) ({m.READY}{{{_SEL}}})", f"ready {slot}"),
        ], "Pods whose /ready answers 200, per slot."),
        ("GPU memory", "percentunit", [
            (f"max by (pod) ({m.GPU_MEMORY_USED}{{{_SEL}}} / clamp_min({m.GPU_MEMORY_TOTAL}{{{_SEL}}}, 1))",
             "{{pod}}"),
        ], "Weights + KV cache + activations; warns at the stack's gpu_memory_warn_ratio."),
    ]
    return [
        _panel(i + 1, title, unit, targets, x=(i % 2) * 12, y=(i // 2) * 8, description=description)
        for i, (title, unit, targets, description) in enumerate(specs)
    ]


def serving_dashboard(title: str = "specdeploy serving") -> dict[str, Any]:
    """The dashboard JSON model, ready for the Grafana sidecar or an import."""
    return {
        "uid": UID,
        "title": title,
        "tags": ["specdeploy", "llm-serving"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
            {
                "name": "namespace",
                "type": "query",
                "label": "Namespace",
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "query": {"query": f"label_values({m.READY}, namespace)", "refId": "namespace"},
                "definition": f"label_values({m.READY}, namespace)",
                "refresh": 2,
            },
        ]},
        "panels": _panels(),
    }
