"""`specdeploy validate` (launch validation, exit code = verdict) and `specdeploy loadgen` (one load phase)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from infra.ops.cli.main import CommandError

PROFILES = ("quick", "standard", "soak")


def register(subparsers: Any) -> None:
    validate = subparsers.add_parser(
        "validate",
        help="run the launch checks against a deployment and write the report (exit code = verdict)",
        description="Functional, host, performance, speculative A/B, stability and observability checks "
        "(infra/validation/launch) against one deployment. Exit code 0 when every check that ran passed, 1 when one "
        "failed, 2 when the suite could not run. API key from $SPECDEPLOY_API_KEY.",
    )
    validate.add_argument("--stack", required=True, help="stack whose SLOs, limits and paths apply")
    validate.add_argument("--endpoint", default=None,
                          help="base URL (default for a local stack: its loopback address and port)")
    validate.add_argument("--profile", default="quick", choices=PROFILES,
                          help="quick: minutes (CI); standard: >= 15 min sustained; soak: hours")
    validate.add_argument("--report", default=None, type=Path, metavar="DIR",
                          help="report directory (default: reports/<stack>-<profile>-<time>)")
    validate.add_argument("--hosts", default=None,
                          help="testinfra backends of the serving hosts, comma separated (default: local://)")
    validate.add_argument("--ab-endpoint", default=None,
                          help="the same deployment with speculation flipped, for the A/B (local: started itself)")
    validate.set_defaults(func=_validate)

    loadgen = subparsers.add_parser(
        "loadgen",
        help="send streaming load to an endpoint and print per-phase latency and throughput as JSON",
        description="Closed loop at fixed concurrency (--concurrency, one phase per level) or open loop at "
        "a Poisson rate (--rate). Prompts come from the bundled prompt sets.",
    )
    loadgen.add_argument("--endpoint", required=True)
    mode = loadgen.add_mutually_exclusive_group(required=True)
    mode.add_argument("--concurrency", default=None, help="closed loop levels, e.g. 1,4,16")
    mode.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    loadgen.add_argument("--duration", type=float, default=None, help="seconds per phase")
    loadgen.add_argument("--requests", type=int, default=None, help="requests per phase (closed loop)")
    loadgen.add_argument("--prompt-set", action="append", default=None,
                         help="code, chat, extraction, writing (repeatable; default all)")
    loadgen.add_argument("--max-tokens", type=int, default=64)
    loadgen.add_argument("--stack", default=None, help="compute goodput against this stack's SLOs")
    loadgen.add_argument("--json", type=Path, default=None, metavar="FILE", help="write phases with every request")
    loadgen.add_argument("--seed", type=int, default=0)
    loadgen.set_defaults(func=_loadgen)


def _validate(args: argparse.Namespace) -> int:
    from infra.validation import run_validation
    from infra.validation.runner import default_endpoint

    extra = ["--ab-endpoint", args.ab_endpoint] if args.ab_endpoint else []
    hosts = [h for h in args.hosts.split(",") if h] if args.hosts else None
    try:
        endpoint = args.endpoint or default_endpoint(args.stack)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    _check_reachable(endpoint, args.stack)
    result = run_validation(endpoint, args.stack, args.profile, args.report, hosts=hosts, extra_args=extra)
    out = sys.stdout
    if not result.summary:
        raise CommandError(f"the launch suite did not write a report (pytest exit code {result.exit_code})")
    out.write(f"\nlaunch verdict: {'PASS' if result.passed else 'FAIL'}\n")
    for nodeid in result.failed_checks:
        out.write(f"  failed: {nodeid}\n")
    rec = result.recommendation
    if rec is not None:
        out.write(f"speculative decoding decision: {'enable' if rec['enabled'] else 'disable'} — {rec['reason']}\n")
        for cell in (result.summary.get("speculative_ab") or {}).get("cells", []):
            d = cell["decision"]
            out.write(f"  {d['prompt_set']:>10} c={d['concurrency']:<3} {d['verdict']:<7} {d['reason']}\n")
    out.write(f"report: {result.report_html}\nsummary: {result.report_markdown}\n")
    return 0 if result.passed else 1


def _check_reachable(endpoint: str, stack: str) -> None:
    import httpx

    try:
        httpx.get(f"{endpoint.rstrip('/')}/health", timeout=10)
    except httpx.HTTPError as exc:
        hint = f"; start it with `specdeploy up --stack {stack}`" if _is_local(stack) else ""
        raise CommandError(f"nothing answers at {endpoint} ({type(exc).__name__}){hint}") from exc


def _is_local(stack: str) -> bool:
    from infra.config import load_stack

    return load_stack(stack).config.platform == "local"


def _loadgen(args: argparse.Namespace) -> int:
    from infra.validation.loadgen import LoadGenerator, SloTargets, load_workloads, run

    if args.concurrency is not None and args.duration is None and args.requests is None:
        raise CommandError("closed loop needs --duration or --requests")
    if args.rate is not None and args.duration is None:
        raise CommandError("open loop needs --duration")
    try:
        workloads = load_workloads(args.prompt_set, args.max_tokens)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    slo = None
    if args.stack:
        from infra.config import load_stack

        slo = SloTargets.from_stack(load_stack(args.stack).config.slo)
    api_key = os.environ.get("SPECDEPLOY_API_KEY")

    async def measure() -> list[Any]:
        async with LoadGenerator(args.endpoint, api_key) as gen:
            if args.rate is not None:
                return [await gen.open_loop(f"open {args.rate:g} req/s", workloads, args.rate, args.duration,
                                            seed=args.seed)]
            levels = [int(c) for c in args.concurrency.split(",") if c]
            return [await gen.closed_loop(f"closed c={c}", workloads, c, duration_s=args.duration,
                                          num_requests=args.requests) for c in levels]

    import httpx

    try:
        phases = run(measure())
    except (OSError, httpx.HTTPError) as exc:
        raise CommandError(f"{args.endpoint}: {exc}") from exc
    summaries = [p.summary(slo) for p in phases]
    sys.stdout.write(json.dumps(summaries, indent=1) + "\n")
    if args.json is not None:
        args.json.write_text(json.dumps([p.to_json(slo) for p in phases], indent=1) + "\n", encoding="utf-8")
    return 0
